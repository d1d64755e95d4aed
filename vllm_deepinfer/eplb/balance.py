"""`moe_lb`: the slowest rank's MoE load over the mean rank load (DeepInfer's metric; vLLM
logs its inverse, "balancedness"). A logical expert's tokens are spread evenly over its
replicas, as vLLM's expert-parallel dispatch spreads them."""

from __future__ import annotations

import numpy as np


def replica_share(phy2log: np.ndarray, num_logical: int, num_ranks: int) -> np.ndarray:
    """[layers, logical, ranks]: the share of each logical expert's tokens each rank
    serves under the placement `phy2log` [layers, physical] (rank = slot // slots per
    rank, vLLM's layout)."""
    layers, physical = phy2log.shape
    if physical % num_ranks:
        raise ValueError(f"{physical} physical experts do not split evenly over {num_ranks} ranks")
    rank_of_slot = np.arange(physical) // (physical // num_ranks)
    share = np.zeros((layers, num_logical, num_ranks))
    for layer in range(layers):
        np.add.at(share[layer], (phy2log[layer], rank_of_slot), 1.0)
    return share / share.sum(-1, keepdims=True)


def rank_loads(logical_load: np.ndarray, share: np.ndarray) -> np.ndarray:
    """[..., layers, ranks] from `logical_load` [..., layers, logical] and a share map."""
    return np.einsum("...le,ler->...lr", logical_load, share)


def moe_lb(loads: np.ndarray) -> np.ndarray:
    """Per layer (last axis: ranks): max / mean; 1.0 for a layer without load."""
    mean = loads.mean(-1)
    return np.where(mean > 0, loads.max(-1) / np.where(mean > 0, mean, 1), 1.0)


def overall_moe_lb(loads: np.ndarray) -> float:
    """All layers together, as vLLM's balancedness sums them: Σ max / Σ mean."""
    mean = loads.mean(-1).sum()
    return float(loads.max(-1).sum() / mean) if mean > 0 else 1.0
