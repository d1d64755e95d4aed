"""Trace-driven EPLB simulation: routing loads per step, the engine's sliding window and
rearrangement interval, and a policy's own `rebalance_experts` deciding each placement.
Measures the `moe_lb` every step would have had at production scale (EP64, EP128)
without running a model.

A trace is per-step logical expert loads `[steps, layers, experts]`, synthetic (Zipf
popularity drifting over time) or recorded from a running engine (`load_trace`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_deepinfer.eplb.balance import rank_loads, replica_share


@dataclass(frozen=True)
class ZipfDrift:
    """Routing loads whose popularity is Zipf(`exponent`)-skewed and drifts: traffic is a
    mix of `workloads` kinds (code, chat, languages...), each preferring its own experts
    by Zipf(`exponent`) over its own random ranking, and the mix shifts over time (the
    mix's logits take a Gaussian random walk that moves them by one standard unit per
    `period` steps). Each step routes `tokens` tokens to `top_k` distinct experts per
    layer, drawn as a multinomial over tokens x top_k picks (an expert's share capped at
    one pick a token)."""

    experts: int = 384
    layers: int = 4
    top_k: int = 6
    tokens: int = 16384
    exponent: float = 1.0
    workloads: int = 4
    period: int = 3000
    seed: int = 0

    def zipf(self, ranking: np.ndarray) -> np.ndarray:
        """[experts]: Zipf weights placed by `ranking` (the expert at each rank)."""
        p = np.empty(self.experts)
        p[ranking] = 1.0 / np.arange(1, self.experts + 1) ** self.exponent
        return p / p.sum()

    def capped(self, p: np.ndarray) -> np.ndarray:
        """`p` with each share capped at 1/top_k, the excess spread over the rest."""
        cap = 1.0 / self.top_k
        while (p > cap + 1e-12).any():
            over = p > cap
            excess = (p[over] - cap).sum()
            p = np.where(over, cap, p + excess * p / p[~over].sum())
        return p

    def loads(self, steps: int) -> np.ndarray:
        """[steps, layers, experts] integer loads."""
        rng = np.random.default_rng(self.seed)
        out = np.empty((steps, self.layers, self.experts), dtype=np.int64)
        picks = self.tokens * self.top_k
        for layer in range(self.layers):
            kinds = np.stack(
                [self.zipf(rng.permutation(self.experts)) for _ in range(self.workloads)]
            )
            walk = np.cumsum(rng.normal(0, 1 / np.sqrt(self.period), (steps, self.workloads)), 0)
            mix = np.exp(walk - walk.max(1, keepdims=True))
            mix /= mix.sum(1, keepdims=True)
            for step in range(steps):
                out[step, layer] = rng.multinomial(picks, self.capped(mix[step] @ kinds))
        return out


def load_trace(path: str) -> np.ndarray:
    """A recorded trace (`.npy`, [steps, layers, experts])."""
    trace = np.load(path)
    if trace.ndim != 3:
        raise ValueError(f"{path}: a trace is [steps, layers, experts], got {trace.shape}")
    return trace


def initial_placement(layers: int, experts: int, redundant: int) -> np.ndarray:
    """vLLM's placement before the first rearrangement: the routed experts in order,
    then the redundant slots holding experts 0, 1, ..."""
    row = np.concatenate([np.arange(experts), np.arange(redundant) % experts])
    return np.tile(row, (layers, 1))


@dataclass(frozen=True)
class Deployment:
    """The expert-parallel layout and the engine's EPLB settings (`--eplb-config`)."""

    ranks: int
    redundant: int
    window: int = 1000
    interval: int = 3000
    nodes: int = 1
    groups: int = 1


def simulate(trace: np.ndarray, deployment: Deployment, policy=None) -> np.ndarray:
    """Per-step `moe_lb` over all layers (Σ max / Σ mean) of `trace` served with
    `deployment`; `policy` (an `AbstractEplbPolicy` class; None: never rearrange) is
    called every `interval` steps with the loads of the last `window` steps, as vLLM's
    EPLB state calls it, and its placement serves the steps that follow."""
    steps, layers, experts = trace.shape
    d = deployment
    placement = initial_placement(layers, experts, d.redundant)
    lbs = np.empty(steps)
    for start in range(0, steps, d.interval):
        if policy is not None and start > 0:
            window = trace[max(0, start - d.window) : start].sum(0)
            placement = policy.rebalance_experts(
                torch.from_numpy(window),
                experts + d.redundant,
                d.groups,
                d.nodes,
                d.ranks,
                torch.from_numpy(placement),
            ).numpy()
        served = rank_loads(
            trace[start : start + d.interval].astype(np.float64),
            replica_share(placement, experts, d.ranks),
        )
        lbs[start : start + d.interval] = served.max(-1).sum(-1) / served.mean(-1).sum(-1)
    return lbs
