"""EPLB at production scale, simulated with the policies' own code: `moe_lb` (busiest
rank's MoE load / mean, per step, all layers together) of vLLM's `default` policy
(DeepSeek's algorithm), the plugin's `deepinfer` policy and no rearrangement, at EP64
and EP128 with Flash's 384 experts (top-6), on Zipf(1.0)-skewed routing traces whose
traffic mix drifts (`vllm_deepinfer.eplb.simulator.ZipfDrift`). The engine's window (1000
steps) and interval (3000 steps) are vLLM's defaults. `oracle` is `default` given each
interval's own loads in advance: what sampling noise and drift inside an interval leave.
With `--trace PATH` (a recorded `[steps, layers, experts]` .npy), the same policies also
run on that trace."""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

EXPERTS, TOP_K = 384, 6
SCALES = {"ep64": 64, "ep128": 128}


def valid_redundant(experts: int, ranks: int, asked: int) -> int:
    """The smallest redundant count >= `asked` that vLLM accepts: every rank holds the
    same number of physical experts."""
    return -(-(experts + asked) // ranks) * ranks - experts


def oracle(trace: np.ndarray, deployment) -> np.ndarray:
    from vllm.distributed.eplb.policy import DefaultEplbPolicy

    from vllm_deepinfer.eplb.balance import rank_loads, replica_share

    steps, layers, experts = trace.shape
    lbs = np.empty(steps)
    for start in range(0, steps, deployment.interval):
        part = trace[start:start + deployment.interval].astype(np.float64)
        placement = DefaultEplbPolicy.rebalance_experts(
            torch.from_numpy(part.sum(0)), experts + deployment.redundant, 1, 1,
            deployment.ranks).numpy()
        served = rank_loads(part, replica_share(placement, experts, deployment.ranks))
        lbs[start:start + deployment.interval] = (served.max(-1).sum(-1)
                                                  / served.mean(-1).sum(-1))
    return lbs


def compare(trace: np.ndarray, ranks: int, redundant: int, interval: int,
            window: int) -> dict:
    """Mean per-step moe_lb of each policy after the first rearrangement."""
    from vllm.distributed.eplb.policy import DefaultEplbPolicy

    from vllm_deepinfer.eplb.policy import DeepInferEplbPolicy
    from vllm_deepinfer.eplb.simulator import Deployment, simulate

    deployment = Deployment(ranks=ranks, redundant=redundant, window=window,
                            interval=interval)
    DeepInferEplbPolicy.forget()
    row = {}
    for name, policy in (("none", None), ("default", DefaultEplbPolicy),
                         ("plugin", DeepInferEplbPolicy)):
        started = time.perf_counter()
        row[name] = round(float(simulate(trace, deployment, policy)[interval:].mean()), 4)
        print(f"  {name:8s} moe_lb {row[name]:.4f}  ({time.perf_counter() - started:.1f} s)")
    row["oracle"] = round(float(oracle(trace, deployment)[interval:].mean()), 4)
    print(f"  oracle   moe_lb {row['oracle']:.4f}")
    row.update(ranks=ranks, redundant_experts=redundant, physical_experts=trace.shape[2]
               + redundant)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redundant", type=int, default=32,
                        help="redundant experts asked for (raised to the next count vLLM "
                             "accepts: equal physical experts per rank)")
    parser.add_argument("--tokens-per-rank", type=int, default=1024,
                        help="tokens each rank routes per step")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--intervals", type=int, default=10,
                        help="rearrangement intervals simulated (the first is not scored)")
    parser.add_argument("--drift-period", type=int, default=100_000,
                        help="steps over which the traffic mix drifts by one standard unit")
    parser.add_argument("--window", type=int, default=1000)
    parser.add_argument("--interval", type=int, default=3000)
    parser.add_argument("--trace", metavar="PATH", help="a recorded trace to run as well")
    parser.add_argument("--json", metavar="PATH", help="also write the figures to PATH")
    args = parser.parse_args()
    from vllm_deepinfer.eplb.simulator import ZipfDrift, load_trace

    results = {}
    for key, ranks in SCALES.items():
        redundant = valid_redundant(EXPERTS, ranks, args.redundant)
        trace = ZipfDrift(experts=EXPERTS, layers=args.layers, top_k=TOP_K,
                          tokens=args.tokens_per_rank * ranks, exponent=1.0,
                          period=args.drift_period).loads(args.intervals * args.interval)
        print(f"{key}: {EXPERTS} experts + {redundant} redundant over {ranks} ranks, "
              f"{args.tokens_per_rank * ranks} tokens a step, {trace.shape[0]} steps")
        results[key] = compare(trace, ranks, redundant, args.interval, args.window)
    if args.trace:
        trace = load_trace(args.trace)
        experts = trace.shape[2]
        ranks = next(r for r in (8, 4, 2, 1) if experts % r == 0)
        print(f"recorded {args.trace}: {trace.shape}, EP{ranks}")
        interval = max(1, min(args.interval, trace.shape[0] // 4))
        results["recorded"] = compare(trace, ranks, valid_redundant(experts, ranks, ranks),
                                      interval, min(args.window, interval))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
