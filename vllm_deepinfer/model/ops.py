"""V4.1's per-token math in plain torch, shared by the paged vLLM model and the dense
reference forward. How keys are gathered (paged cache vs whole sequence) is the caller's
business; everything here works on already-assembled tensors."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

HC_POST_ALPHA = 2.0


def _wide(x: torch.Tensor) -> torch.Tensor:
    """At least fp32: the reference may run everything in fp64."""
    return x if x.dtype == torch.float64 else x.float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = _wide(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * _wide(weight)
    return y.to(x.dtype)


# --- RoPE --------------------------------------------------------------------------------
def rope_inv_freq(rope_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Per-pair inverse frequencies; YaRN's ramp between original and stretched ones."""
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim
    extrapolated = theta ** -exponents
    if not scaling:
        return extrapolated.float()
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])

    def correction_dim(rotations: float) -> float:
        return rope_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(scaling.get("beta_fast", 32))), 0)
    high = min(math.ceil(correction_dim(scaling.get("beta_slow", 1))), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return (extrapolated / factor * ramp + extrapolated * (1 - ramp)).float()


def layer_rope_scaling(rope_scaling: dict, ratio: int) -> dict | None:
    """SWA-only layers use plain RoPE; compressed layers use the config's YaRN."""
    if ratio == 0:
        return None
    scaling = rope_scaling
    if isinstance(scaling.get("main"), dict) and isinstance(scaling.get("compress"), dict):
        scaling = scaling["compress"]
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return None if kind == "default" else scaling


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
               inverse: bool = False) -> torch.Tensor:
    """Interleaved (GPT-J) rotation of the last 2*len(inv_freq) dims. x: [T, ..., D]."""
    rope_dim = 2 * inv_freq.numel()
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    angles = positions.to(wide)[:, None] * inv_freq[None, :].to(wide)
    shape = [x.shape[0]] + [1] * (x.dim() - 2) + [rope_dim // 2]
    cos, sin = angles.cos().view(shape), angles.sin().view(shape)
    if inverse:
        sin = -sin
    rot = _wide(x[..., -rope_dim:])
    even, odd = rot[..., 0::2], rot[..., 1::2]
    rotated = torch.stack([even * cos - odd * sin, odd * cos + even * sin], -1).flatten(-2)
    return torch.cat([x[..., :-rope_dim], rotated.to(x.dtype)], dim=-1)


# --- hyper-connections --------------------------------------------------------------------
def hc_mixes(copies: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
             hc_eps: float, rms_eps: float, sinkhorn_iters: int):
    """One boundary's (pre [T, hc], post [T, hc], comb [T, hc, hc]) from copies [T, hc, H]."""
    t, hc, _ = copies.shape
    flat = _wide(copies.reshape(t, -1))
    mixes = (flat @ _wide(fn).T) * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + rms_eps)
    pre = torch.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = torch.sigmoid(mixes[:, hc:2 * hc] * scale[1] + base[hc:2 * hc]) * HC_POST_ALPHA
    comb = (mixes[:, 2 * hc:] * scale[2] + base[2 * hc:]).view(t, hc, hc)
    comb = comb.softmax(-1) + hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    return pre, post, comb


def hc_update(copies: torch.Tensor, comb: torch.Tensor, post: torch.Tensor,
              out: torch.Tensor) -> torch.Tensor:
    """copies'[j] = sum_i comb[i, j] * copies[i] + post[j] * out."""
    mixed = torch.einsum("tij,tih->tjh", comb, _wide(copies))
    return (mixed + post[:, :, None] * _wide(out)[:, None, :]).to(copies.dtype)


def hc_collapse(copies: torch.Tensor, pre: torch.Tensor | None) -> torch.Tensor:
    """Sublayer input: the pre-weighted sum of copies (copy 0 before any pre exists)."""
    if pre is None:
        return copies[:, 0]
    return torch.einsum("tj,tjh->th", pre, _wide(copies)).to(copies.dtype)


# --- attention ----------------------------------------------------------------------------
def sink_attention(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor,
                   sink: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, nH, D], keys [K, D] (value = key), mask [T, K]; the per-head sink is one more
    logit with a zero value, so heads may attend to nothing."""
    logits = torch.einsum("thd,kd->thk", _wide(q), _wide(keys)) * scale
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    sink_logits = _wide(sink)[None, :, None].expand(q.shape[0], -1, 1)
    probs = torch.cat([logits, sink_logits], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("thk,kd->thd", probs, _wide(keys)).to(q.dtype)


def grouped_output(o: torch.Tensor, wo_a: torch.Tensor, o_groups: int) -> torch.Tensor:
    """Per-group low-rank output: [T, nH, D] -> [T, o_groups * o_lora_rank]."""
    t = o.shape[0]
    grouped = o.reshape(t, o_groups, -1)
    w = wo_a.view(o_groups, -1, grouped.shape[-1])
    return torch.einsum("tgi,gri->tgr", grouped, w.to(o.dtype)).reshape(t, -1)


# --- compressor and lightning indexer -----------------------------------------------------
def pool_pair(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """Ratio-2 group: per-dimension softmax over the two tokens' scores. kv, score: [2, G, D]."""
    return (kv * score.softmax(0)).sum(0)


def index_scores(q_idx: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q_idx [T, nI, dI], weights [T, nI], keys [G, dI] -> [T, G]: sum_h w_h relu(q_h . k)."""
    s = torch.einsum("thd,gd->thg", _wide(q_idx), _wide(keys)).relu()
    return (s * _wide(weights)[:, :, None]).sum(1)


def _best(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest per row, ties to the lower index (ReLU makes exact ties
    common, and a stable order keeps paged and dense gathers in agreement)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


def candidate_blocks(scores: torch.Tensor, n_visible: torch.Tensor, block_size: int,
                     topk_blocks: int) -> torch.Tensor:
    """Boolean [T, G] mask of positions inside each row's best blocks (block score = max
    visible score); the block holding the newest visible position always qualifies."""
    t, g = scores.shape
    n_blocks = -(-g // block_size)
    positions = torch.arange(g)
    visible = positions[None, :] < n_visible[:, None]
    padded = torch.full((t, n_blocks * block_size), float("-inf"), dtype=_wide(scores).dtype)
    padded[:, :g] = _wide(scores).masked_fill(~visible, float("-inf"))
    block_score = padded.view(t, n_blocks, block_size).amax(-1)
    newest = ((n_visible - 1).clamp_min(0) // block_size)
    block_score[torch.arange(t), newest] = float("inf")
    chosen = _best(block_score, min(topk_blocks, n_blocks))
    keep = torch.zeros(t, n_blocks, dtype=torch.bool)
    keep.scatter_(1, chosen, torch.gather(block_score, 1, chosen) > float("-inf"))
    return keep[:, positions // block_size] & visible


def select_topk(scores: torch.Tensor, allowed: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean [T, G] selection of the k best allowed positions (all if fewer)."""
    masked = _wide(scores).masked_fill(~allowed, float("-inf"))
    chosen = _best(masked, min(k, scores.shape[1]))
    selected = torch.zeros_like(allowed)
    selected.scatter_(1, chosen, True)
    return selected & allowed


# --- MoE ----------------------------------------------------------------------------------
def route(logits: torch.Tensor, bias: torch.Tensor, top_k: int,
          scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """sqrtsoftplus scores; the bias steers selection only; weights renormalised x scaling."""
    scores = torch.sqrt(F.softplus(_wide(logits)))
    chosen = _best(scores + _wide(bias), top_k)
    weights = torch.gather(scores, 1, chosen)
    weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20) * scaling
    return weights, chosen


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


# --- Engram -------------------------------------------------------------------------------
def engram_gate(copies: torch.Tensor, keys: torch.Tensor, value: torch.Tensor,
                q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """copies [T, hc, H], keys [T, hc, H], value [T, H]: each copy gates the shared value
    by a signed-sqrt sigmoid of its normalised dot with its own key."""
    h = copies.shape[-1]
    x = rms_norm(_wide(copies), None, eps) * _wide(q_weight)
    k = rms_norm(_wide(keys), None, eps) * _wide(k_weight)
    dot = (x * k).sum(-1) / math.sqrt(h)
    sign = torch.where(dot >= 0, 1.0, -1.0)
    gate = torch.sigmoid(sign * dot.abs().clamp_min(1e-6).sqrt())
    return (_wide(copies) + gate[..., None] * _wide(value)[:, None, :]).to(copies.dtype)
