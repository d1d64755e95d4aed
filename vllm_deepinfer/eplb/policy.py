"""The plugin's EPLB policy (`--eplb-config '{"policy": "deepinfer"}'`): a placement
that stays balanced while the traffic mix shifts.

vLLM's `default` (DeepSeek's algorithm) balances the loads of the last window only; when
the mix of traffic moves on before the next rearrangement, experts that were cool get
hot on ranks sized for their old load. This policy remembers the last few windows' loads
(each normalised to its own total) and chooses the placement that minimises the worst
`moe_lb` over scenarios: the current window, the earlier ones, and each earlier one
mirrored through the current (the mix is as likely to move on as it moved here). The
busiest rank's load is convex in the loads, so every mix of the scenarios' traffic is
served at least as evenly as the worst of them.

Per layer: redundant slots go one by one to the expert whose busiest replica is busiest
in any scenario; replicas are packed onto ranks heaviest first, each onto the
rank (with a free slot) that keeps the worst scenario's busiest rank lowest; then the
busiest rank trades replicas with others while that lowers it. Finally, as `default`
does, experts that stay on a rank keep their slots (no weight copy)."""

from __future__ import annotations

import threading
from collections import deque

import numpy as np
import torch
from vllm.distributed.eplb.policy import AbstractEplbPolicy, DefaultEplbPolicy

# How many windows the policy remembers: the current one and three before it.
REMEMBERED_WINDOWS = 4
# Trades the busiest rank tries per layer before the packing is final.
MAX_TRADES = 256


def replicate(loads: np.ndarray, num_physical: int) -> np.ndarray:
    """Replica count per expert: each extra slot to the expert whose load per replica is
    highest in any scenario. loads [scenarios, experts]."""
    experts = loads.shape[1]
    count = np.ones(experts, dtype=np.int64)
    worst = loads.max(0)
    for _ in range(num_physical - experts):
        count[np.argmax(worst / count)] += 1
    return count


def pack(items: np.ndarray, num_ranks: int) -> np.ndarray:
    """Rank of each item (replica) with equal counts per rank, minimising the worst
    scenario's busiest rank. items [replicas, scenarios], each scenario's loads summing to the
    same total over all items."""
    replicas, cases = items.shape
    per_rank = replicas // num_ranks
    mean = items.sum(0) / num_ranks
    load = np.zeros((num_ranks, cases))
    free = np.full(num_ranks, per_rank)
    rank = np.empty(replicas, dtype=np.int64)
    for item in np.argsort(-(items / mean).max(1), kind="stable"):
        after = ((load + items[item]) / mean).max(1)
        after[free == 0] = np.inf
        chosen = int(np.argmin(after))
        rank[item] = chosen
        load[chosen] += items[item]
        free[chosen] -= 1
    return _trade(items, rank, load, mean)


def _trade(items, rank, load, mean):
    """Swaps a replica of the busiest rank with one elsewhere while that lowers the
    worst rank of both and the swap partner stays below the old worst."""
    for _ in range(MAX_TRADES):
        scaled = load / mean
        busiest = int(np.argmax(scaled.max(1)))
        worst = scaled[busiest].max()
        mine = np.flatnonzero(rank == busiest)
        theirs = np.flatnonzero(rank != busiest)
        # delta[i, j]: scenario loads moving off the busiest rank when i and j trade.
        delta = items[mine][:, None, :] - items[theirs][None, :, :]
        new_busiest = ((load[busiest] - delta) / mean).max(-1)
        new_other = ((load[rank[theirs]][None] + delta) / mean).max(-1)
        after = np.maximum(new_busiest, new_other)
        i, j = np.unravel_index(np.argmin(after), after.shape)
        if after[i, j] >= worst - 1e-9:
            break
        a, b = mine[i], theirs[j]
        load[busiest] += items[b] - items[a]
        load[rank[b]] += items[a] - items[b]
        rank[a], rank[b] = rank[b], busiest
    return rank


def scenarios(history: np.ndarray) -> np.ndarray:
    """[scenarios, ...]: the remembered windows [windows, ...] (current last) and each
    earlier one mirrored through the current, renormalised."""
    current, earlier = history[-1], history[:-1]
    mirrored = np.clip(2 * current[None] - earlier, 0, None)
    mirrored /= np.maximum(mirrored.sum(-1, keepdims=True), 1e-30)
    return np.concatenate([history, mirrored])


def place(loads: np.ndarray, num_physical: int, num_ranks: int) -> np.ndarray:
    """phy2log [physical] for one layer from its scenarios' loads [scenarios, experts]."""
    experts = loads.shape[1]
    count = replicate(loads, num_physical)
    expert_of = np.repeat(np.arange(experts), count)
    items = (loads / count).T[expert_of]  # [replicas, scenarios]: an even share each
    rank = pack(items, num_ranks)
    order = np.lexsort((expert_of, rank))  # rank by rank, experts in order within one
    return expert_of[order]


class DeepInferEplbPolicy(AbstractEplbPolicy):
    """Registered as `deepinfer` in vLLM's EPLB policies (see `register`)."""

    _history: dict[tuple, deque] = {}
    _lock = threading.Lock()

    @classmethod
    def forget(cls) -> None:
        """Drops every remembered window (a new deployment, a benchmark run)."""
        with cls._lock:
            cls._history.clear()

    @classmethod
    def remembered(cls, weight: np.ndarray, key: tuple) -> np.ndarray:
        """[windows, layers, experts]: this window's loads and the last ones of the
        same model and layout, each normalised per layer."""
        total = weight.sum(-1, keepdims=True)
        share = np.where(total > 0, weight / np.where(total > 0, total, 1), 1 / weight.shape[1])
        with cls._lock:
            history = cls._history.setdefault(key, deque(maxlen=REMEMBERED_WINDOWS))
            history.append(share)
            return np.stack(history)

    @classmethod
    def rebalance_experts(
        cls,
        weight: torch.Tensor,
        num_replicas: int,
        num_groups: int,
        num_nodes: int,
        num_ranks: int,
        old_global_expert_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """vLLM's policy entry point (see `AbstractEplbPolicy`). Ranks are treated as
        one flat pool: V4.1 routes without expert groups."""
        loads = weight.float().cpu().numpy().astype(np.float64)
        layers, experts = loads.shape
        if num_replicas % num_ranks or num_replicas < experts:
            raise ValueError(
                f"{num_replicas} physical experts cannot hold {experts} "
                f"experts evenly over {num_ranks} ranks"
            )
        planned = scenarios(cls.remembered(loads, (layers, experts, num_replicas, num_ranks)))
        phy2log = np.stack(
            [place(planned[:, layer], num_replicas, num_ranks) for layer in range(layers)]
        )
        if old_global_expert_indices is not None:
            phy2log = DefaultEplbPolicy.preserve_intragpu_slots(
                phy2log, num_ranks, old_global_expert_indices.cpu().numpy()
            )
        return torch.from_numpy(phy2log)
