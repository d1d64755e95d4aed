"""V4.1's opaque layer ops: what reads step metadata or paged caches, or makes shapes that
depend on the data, as one registered op per layer call. vLLM traces the model once,
without metadata, into one graph; these stay nodes in it (their fake implementations give
nothing but the declared writes), and everything between them (norms, linears, RoPE,
hyper-connection mixing and Sinkhorn, router scores and top-k, activations, the shared
expert) is traced for Inductor to fuse. The same ops run eagerly under `--enforce-eager`.

Each op finds its module by name in the forward context (as vLLM's own attention ops do)
and writes into a buffer the graph allocated before it: the boundary that CUDA graphs need
as well (preallocated outputs, nothing returned that the op allocated). Where vLLM has
breakable CUDA graphs, each op is one of their eager breaks (a no-op wrapper otherwise)."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.library import Library
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.utils.torch_utils import direct_register_custom_op

try:
    from vllm.compilation.breakable_cudagraph import eager_break_during_capture
except ImportError:  # a vLLM without breakable CUDA graphs: nothing to break

    def eager_break_during_capture(fn):
        return fn


LIBRARY = Library("deepinfer", "FRAGMENT")  # noqa: TOR901 (kept alive for the process)


class _Owner:
    """What the forward context holds for a layer op's module. vLLM pickles its config
    (the forward context's dict included) for processes that never run the model, and the
    module's linear layers cannot be pickled: the pickled handle is empty."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __getstate__(self):
        return {"module": None}

    def __deepcopy__(self, memo):
        return self


def register_owner(name: str, module: nn.Module) -> str:
    """Makes `module` findable by its ops under `name` (unique per engine); returns it."""
    layers = get_current_vllm_config().compilation_config.static_forward_context
    if name in layers:
        raise ValueError(f"duplicate layer op name {name}")
    layers[name] = _Owner(module)
    return name


def _owner(name: str) -> nn.Module:
    return get_forward_context().no_compile_layers[name].module


@eager_break_during_capture
def _attention(
    q: torch.Tensor,
    latent: torch.Tensor,
    compressed: torch.Tensor | None,
    compressed_index_keys: torch.Tensor | None,
    index_q: torch.Tensor | None,
    index_weights: torch.Tensor | None,
    positions: torch.Tensor,
    out: torch.Tensor,
    layer_name: str,
) -> None:
    """Cache writes (window, compressor), the indexer's top-k and sparse attention of one
    layer: `out` [T, heads, head_dim] gets the attention output (zeros where none)."""
    _owner(layer_name).attend_step(
        q, latent, compressed, compressed_index_keys, index_q, index_weights, positions, out
    )


@eager_break_during_capture
def _routed_experts(
    x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, out: torch.Tensor, layer_name: str
) -> None:
    """One MoE layer's routed experts: dispatch (across data-parallel ranks under expert
    parallelism), EPLB's physical replicas and load, grouped experts, combine into `out`."""
    _owner(layer_name).routed_step(x, weights, chosen, out)


@eager_break_during_capture
def _ngram_history(
    input_ids: torch.Tensor, positions: torch.Tensor, out: torch.Tensor, layer_name: str
) -> None:
    """Engram's token history: writes the step's ids into its paged cache and reads the
    n-gram history [T, max_ngram] of every token into `out`."""
    _owner(layer_name).ngram_history_step(input_ids, positions, out)


@eager_break_during_capture
def _engram_rows(table_rows: torch.Tensor, out: torch.Tensor, layer_name: str) -> None:
    """One Engram layer's table rows [T, columns, head_dim] into `out`, read from the
    mapped checkpoint (the table is not a tensor of the graph)."""
    _owner(layer_name).lookup_step(table_rows, out)


@eager_break_during_capture
def _draft_context(
    latents: torch.Tensor, positions: torch.Tensor, stored: torch.Tensor, layer_name: str
) -> None:
    """DSpark's context: each draft stage's window gets its latents [stages, T, D] of the
    step's tokens; `stored` (the draft's step counter) counts the steps that wrote it."""
    _owner(layer_name).store_context_step(latents, positions, stored)


@eager_break_during_capture
def _draft_attention(
    q: torch.Tensor, own: torch.Tensor, out: torch.Tensor, stage: int, layer_name: str
) -> None:
    """One DSpark stage's attention over the draft blocks (context read from the stage's
    window, plus the blocks' own latents): `out` [B*N, heads, head_dim]."""
    _owner(layer_name).attend_block(stage, q, own, out)


def register_function(name: str, func, fake):
    """A registered op that writes nothing and returns a new tensor (`fake` gives its
    shape), opaque to the compiled graph: torch.ops.deepinfer.<name>."""
    direct_register_custom_op(
        op_name=name, op_func=func, mutates_args=[], fake_impl=fake, target_lib=LIBRARY
    )
    return getattr(torch.ops.deepinfer, name)


def _nothing(*args, **kwargs) -> None:
    """Fake implementation: the ops return nothing; their writes are declared."""


def register_writer(name: str, func, writes: list[str]):
    """A registered op that writes the arguments named in `writes` in place and returns
    nothing, opaque to the compiled graph: torch.ops.deepinfer.<name>."""
    direct_register_custom_op(
        op_name=name, op_func=func, mutates_args=writes, fake_impl=_nothing, target_lib=LIBRARY
    )
    return getattr(torch.ops.deepinfer, name)


for _name, _fn, _writes in (
    ("v41_attention", _attention, ["out"]),
    ("v41_routed_experts", _routed_experts, ["out"]),
    ("v41_ngram_history", _ngram_history, ["out"]),
    ("v41_draft_context", _draft_context, ["stored"]),
    ("v41_draft_attention", _draft_attention, ["out"]),
    ("v41_engram_rows", _engram_rows, ["out"]),
):
    register_writer(_name, _fn, _writes)

attention = torch.ops.deepinfer.v41_attention
routed_experts = torch.ops.deepinfer.v41_routed_experts
ngram_history = torch.ops.deepinfer.v41_ngram_history
draft_context = torch.ops.deepinfer.v41_draft_context
draft_attention = torch.ops.deepinfer.v41_draft_attention
engram_rows = torch.ops.deepinfer.v41_engram_rows
