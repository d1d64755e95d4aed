"""DeepSeek V4.1-Flash for vLLM, portable: plain torch on vLLM's layers and KV cache manager.

Embedding -> `hc_mult` residual copies -> decoder layers (decoder.py) -> collapse ->
final norm -> LM head. Every cache V4.1 keeps is paged by vLLM (kv_cache/specs.py);
attention gathers its keys per request from those caches, so chunked prefill, mixed
batches, preemption and prefix caching work as for any vLLM model.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
import torch.nn as nn
from tokenizers import Tokenizer
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    UnquantizedEmbeddingMethod,
    VocabParallelEmbedding,
)
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import MixtureOfExperts
from vllm.platforms import current_platform

from vllm_deepinfer.checkpoint.formats import scale_name
from vllm_deepinfer.checkpoint.layout import (
    backbone_layout,
    dspark_layout,
    is_backbone,
    is_vision,
    vision_layout,
)
from vllm_deepinfer.checkpoint.loader import Stored, checked
from vllm_deepinfer.determinism import batch_invariant
from vllm_deepinfer.kernels import paths, weight_gemv
from vllm_deepinfer.kv_cache.bounded_replay import replay_settings, tracker_for
from vllm_deepinfer.kv_cache.specs import engram_token_history
from vllm_deepinfer.logger import init_logger
from vllm_deepinfer.model.deepseek_v41 import layer_ops
from vllm_deepinfer.model.deepseek_v41.args import IMAGE_TOKEN_ID, V41Args
from vllm_deepinfer.model.deepseek_v41.compilation import (
    compile_tag,
    compiled_unless_batch_invariant,
)
from vllm_deepinfer.model.deepseek_v41.decoder import V41DecoderLayer
from vllm_deepinfer.model.deepseek_v41.dspark import (
    V41DSpark,
    block_inputs,
    entry_stream,
    markov_draft,
)
from vllm_deepinfer.model.deepseek_v41.engram import NO_TOKEN, engram_addressing, history_ids
from vllm_deepinfer.model.deepseek_v41.hyper_connections import hc_collapse
from vllm_deepinfer.model.deepseek_v41.layer_ops import register_owner
from vllm_deepinfer.model.deepseek_v41.moe import routed_as_image
from vllm_deepinfer.model.deepseek_v41.quantization import log_precision
from vllm_deepinfer.model.deepseek_v41.registration import uses_dspark_stages
from vllm_deepinfer.model.deepseek_v41.step import DraftBlock, StepBatch, StepScope

logger = init_logger(__name__)


@support_torch_compile(
    dynamic_arg_dims={"input_ids": 0, "positions": 0, "inputs_embeds": 0},
    enable_if=compiled_unless_batch_invariant,
)
class V41Model(nn.Module):
    """The paged model as vLLM compiles it: one graph over every layer, with the parts
    that read the step's caches as opaque layer ops (layer_ops.py) that share the step's
    context through one `StepScope`."""

    def __init__(self, a: V41Args, *, vllm_config: VllmConfig, prefix: str, with_draft: bool):
        super().__init__()
        self.a = a
        self.replay = replay_settings(vllm_config, a)
        tracker_for(vllm_config).configure(self.replay.keep, self.replay.cut is not None)
        if self.replay.keep:
            logger.info(
                "Bounded replay of %d tokens; decoder-side replay %s",
                self.replay.keep,
                "off" if self.replay.cut is None else f"from layer {self.replay.cut}",
            )
        self.embed = VocabParallelEmbedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(
            V41DecoderLayer(a, i, f"{prefix}.layers.{i}", vllm_config, self.replay)
            for i in range(a.num_hidden_layers)
        )
        self.norm = RMSNorm(a.hidden_size, eps=a.rms_norm_eps)
        # DSpark's stages, built only when speculative decoding uses them (their caches
        # would otherwise take memory for nothing).
        self.draft = None
        if with_draft:
            with compile_tag("dspark_draft"):
                self.draft = V41DSpark(
                    a=a, replay=self.replay, vllm_config=vllm_config, prefix=f"{prefix}.draft"
                )
        self.scope = StepScope(
            self.layers[0].attn.window,
            {i: self.layers[i].attn for i in a.kv_source_layer_ids},
            self.replay.cut,
        )
        for layer in self.layers:
            layer.attn.scope = layer.ffn.scope = self.scope
        if self.draft is not None:
            self.draft.scope = self.scope
        self.engram_history = None
        if a.engram_layer_ids:
            # Token history for n-grams that reach back across chunk and decode steps.
            self.engram_history = engram_token_history(
                f"{prefix}.layers.{a.engram_layer_ids[0]}",
                a,
                vllm_config.cache_config.block_size,
                self.replay.keep,
            )
            self.op_name = register_owner(f"{prefix}.engram", self)

    def prepare_engram(self, tokenizer_dir: str) -> None:
        """Builds Engram's addressing from the tokenizer (after loading, so that the model
        itself can be instantiated without one) and checks it against the config."""
        tokenizer = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
        compressed_ids, hashing = engram_addressing(tokenizer, self.a)
        device = self.embed.weight.device
        self.compressed_ids, self.hashing = compressed_ids.to(device), hashing.to(device)

    def ngram_history_step(
        self, input_ids: torch.Tensor, positions: torch.Tensor, out: torch.Tensor
    ) -> None:
        """The layer op (layer_ops.py): `out` [T, max_ngram] gets the compressed ids at
        p, p-1, ... of the step's real tokens (NO_TOKEN before the start and at image
        tokens)."""
        ctx = self.scope.context(positions)
        n = input_ids.shape[0] if ctx.batch is None else ctx.batch.num_tokens
        out[:n] = self._ngram_history(input_ids[:n], ctx.positions, ctx.batch)

    def _ngram_history(
        self, input_ids: torch.Tensor, positions: torch.Tensor, step: StepBatch | None
    ) -> torch.Tensor:
        n = self.a.engram_max_ngram_size
        current = history_ids(self.compressed_ids[input_ids], input_ids)
        md = self.engram_history.metadata()
        if step is None or md is None:
            history = torch.full(
                (input_ids.shape[0], n), NO_TOKEN, dtype=torch.int64, device=input_ids.device
            )
            history[:, 0] = current
            return history
        self.engram_history.write(md, md.slot_mapping, current.float()[:, None])
        earlier = positions[:, None] - torch.arange(n, device=positions.device)
        request = step.request_of_token[:, None]
        start = step.replay_start[request]  # rows before it were not written by this request
        ids = self.engram_history.read(md, request, torch.maximum(earlier, start))[..., 0].long()
        if md.tokens_before_replay is not None:
            # A replay starts after ids the window caches no longer hold: the runner's.
            before = md.tokens_before_replay.to(ids.device)
            depth = before.shape[1]
            lookback = history_ids(self.compressed_ids[before.clamp_min(0)], before)
            lookback = lookback.masked_fill(before < 0, NO_TOKEN)
            column = (earlier - start + depth).clamp(0, depth - 1)
            ids = torch.where(earlier < start, lookback[request, column], ids)
        return torch.where(earlier >= 0, ids, NO_TOKEN)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`inputs_embeds`: the runner's embeddings where a prompt holds images (the
        token ids still come, for routing and Engram). Rows the step does not compute
        (the runner's padding; with decoder-side replay, prompt rows before the kept
        ones) return values no sampler reads."""
        a = self.a
        image_tokens = input_ids == IMAGE_TOKEN_ID
        vision_routed = routed_as_image(input_ids) if a.vision_language else None
        engram_rows = {}
        if self.engram_history is not None:
            history = torch.full(
                (input_ids.shape[0], a.engram_max_ngram_size),
                NO_TOKEN,
                dtype=torch.int64,
                device=input_ids.device,
            )
            layer_ops.ngram_history(input_ids, positions, history, self.op_name)
            engram_rows = {layer: self.hashing.rows(layer, history) for layer in a.engram_layer_ids}
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        copies = x[:, None, :].expand(-1, a.hc_mult, -1).contiguous()
        pre = None
        streams = []  # DSpark's inputs: the target layers' entry streams
        for layer in self.layers:
            if self.draft is not None and layer.layer in a.dspark_targets:
                streams.append(entry_stream(copies))
            copies, pre = layer(
                copies, pre, positions, engram_rows.get(layer.layer), image_tokens, vision_routed
            )
        if self.draft is not None:
            latents = self.draft.context_latents(torch.cat(streams, -1), positions)
            layer_ops.draft_context(latents, positions, self.draft.stored_steps, self.draft.op_name)
        return self.norm(hc_collapse(copies, pre))


# Checkpoint tensors that are row blocks of one parameter: suffix -> (its suffix, block).
# The compressor's wkv and wgate read the same input, so they are one product.
_ROW_BLOCKS = {
    "attn.compressor.wkv.weight": ("attn.compressor.wkv_gate.weight", 0),
    "attn.compressor.wgate.weight": ("attn.compressor.wkv_gate.weight", 1),
}

# Checkpoint names that differ from parameter names (everything else is `model.` + name).
_RENAMES = (
    *((old, new) for old, (new, _) in _ROW_BLOCKS.items()),
    ("attn.compressor.norm.weight", "attn.compressor.norm"),
    ("attn.indexer.wk.weight", "attn.compressor.wk.weight"),
    ("attn.indexer.k_norm.weight", "attn.compressor.k_norm"),
    ("attn.wo_a.weight", "attn.wo_a"),
    ("attn.wo_a.scale", "attn.wo_a_scale"),
)


# DSpark's combiner and heads (on `mtp.0` and the last stage) -> the draft's parameters.
_DRAFT_HEADS = {
    "main_proj.weight": "main_proj.weight",
    "main_proj.scale": "main_proj.weight_scale",
    "main_norm.weight": "main_norm.weight",
    "norm.weight": "norm.weight",
    "markov_head.embed.weight": "markov_embed",
    "markov_head.head.weight": "markov_head",
    "confidence_head.proj.weight": "confidence",
}


HEAD_TILE_ROWS = 16384
"""Vocabulary rows of the head multiplied at once on the CPU: oneDNN reorders the weight
of each product into its own layout, a copy as large as the rows multiplied."""
PACKED_HEAD_MAX_BYTES = 256 << 20
"""Heads up to this size keep vLLM's packed oneDNN kernel (a second copy, and the
fastest product); larger ones (Flash's: 1.3 GB in bf16) keep one copy."""


class UntiedHeadMethod(UnquantizedEmbeddingMethod):
    """The head's one copy, multiplied in place on the CPU, HEAD_TILE_ROWS vocabulary rows
    at a time, where the head is larger than PACKED_HEAD_MAX_BYTES. vLLM's CPU head hands
    its weight to a packed oneDNN kernel, which keeps a reordered second copy besides the
    weight (for heads tied to the embedding), and one aten product over the whole weight
    reorders a transient one: 1.3 GB each at Flash's vocabulary in bf16. V4.1's head is
    untied. Smaller heads keep vLLM's kernel (about twice as fast at small batches)
    where the CPU multiplies bf16 natively; without native bf16, vLLM falls back to aten,
    which widens the whole bf16 weight on every call, so there the head is multiplied in
    place too.
    In place, a decode-sized product over a bf16 head runs the plugin's C kernel
    (kernels/weight_gemv.py), which reads the weight once; larger ones multiply tiles
    widened to fp32 where the CPU lacks native bf16. On the tiny model's head (2-core AVX2
    machine), aten against the kernel: 6.2 against 4.9 ms for one row, 39 against 18 ms
    for eight; at 64 rows aten against widened tiles: 357 against 96 ms."""

    def _one_copy(self, layer: nn.Module) -> bool:
        weight = layer.weight
        return current_platform.is_cpu() and weight.numel() * weight.element_size() > (
            PACKED_HEAD_MAX_BYTES
        )

    def _widened_by_vllm(self, layer: nn.Module) -> bool:
        """Whether vLLM's product would widen this bf16 head on every call."""
        return (
            current_platform.is_cpu()
            and layer.weight.dtype == torch.bfloat16
            and not weight_gemv.native_bf16()
        )

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not self._one_copy(layer):
            super().process_weights_after_loading(layer)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if not (self._one_copy(layer) or self._widened_by_vllm(layer)):
            return super().apply(layer, x, bias)
        weight = layer.weight
        invariant = batch_invariant.enabled()
        if weight.dtype == torch.bfloat16 and not invariant and weight_gemv.fits(x):
            logits = weight_gemv.product(x, weight, None, weight_gemv.BF16)
            return logits if bias is None else logits + bias
        compute = x.dtype
        if not invariant and self._widened_by_vllm(layer):
            compute = torch.float32  # rounded to x's dtype once, as a bf16 product rounds
        rows = x.to(compute)
        logits = x.new_empty(*x.shape[:-1], weight.shape[0])
        for start in range(0, weight.shape[0], HEAD_TILE_ROWS):
            stop = min(start + HEAD_TILE_ROWS, weight.shape[0])
            logits[..., start:stop] = batch_invariant.project(rows, weight[start:stop].to(compute))
        return logits if bias is None else logits + bias


def is_encoder_only(vllm_config: VllmConfig) -> bool:
    """An E instance of E/P/D (`--mm-encoder-only`, or `ec_role` ec_producer, which vLLM
    turns into it): only the vision tower runs there."""
    mm_config = vllm_config.model_config.multimodal_config
    return bool(mm_config and mm_config.mm_encoder_only)


class DeepseekV41ForCausalLM(nn.Module, MixtureOfExperts):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        if vllm_config.parallel_config.pipeline_parallel_size != 1:
            raise ValueError(
                "vllm-deepinfer's V4.1 model runs with "
                "pipeline_parallel_size=1 (tensor, data and expert "
                "parallelism are supported)"
            )
        self.config = config
        self.tokenizer_dir = vllm_config.model_config.tokenizer
        self.checkpoint_dir = vllm_config.model_config.model
        log_precision(vllm_config.quant_config, vllm_config.model_config.dtype)
        self.args = V41Args.from_hf_config(config)
        if current_platform.is_cpu():
            a = self.args
            dtype = vllm_config.model_config.dtype
            paths.log_once(
                paths.Model(
                    dtype, a.n_routed_experts, a.num_experts_per_tok, batch_invariant.enabled()
                )
            )
        self.encoder_only = is_encoder_only(vllm_config)
        if self.encoder_only and vllm_config.parallel_config.enable_eplb:
            raise ValueError(
                "--enable-eplb on an encoder-only instance (--mm-encoder-only "
                "or ec_role ec_producer): it runs no experts to balance"
            )
        self._build_language_model(vllm_config, prefix)
        if not self.encoder_only:
            self._describe_experts_for_eplb()

    def _build_language_model(self, vllm_config: VllmConfig, prefix: str) -> None:
        """The text model: the backbone (with DSpark's stages when speculative decoding
        uses them), the head and the logits."""
        with_draft = uses_dspark_stages(vllm_config)
        if with_draft and not self.args.dspark_stages:
            raise ValueError(
                "DSpark speculative decoding needs a checkpoint with DSpark "
                "stages (num_nextn_predict_layers and the dspark_* config)"
            )
        self.model = V41Model(
            self.args,
            vllm_config=vllm_config,
            prefix="model" if not prefix else f"{prefix}.model",
            with_draft=with_draft,
        )
        self.lm_head = ParallelLMHead(self.args.vocab_size, self.args.hidden_size)
        self.lm_head.quant_method = UntiedHeadMethod()
        self.logits_processor = LogitsProcessor(self.args.vocab_size)

    def _describe_experts_for_eplb(self) -> None:
        """vLLM's `MixtureOfExperts` interface: what its EPLB state reads and moves (the
        backbone's MoE layers; the DSpark stages' experts stay whole on every rank)."""
        self.moe_layers = [layer.ffn for layer in self.model.layers]
        placement = self.moe_layers[0].placement
        self.expert_weights = []
        self.num_moe_layers = len(self.moe_layers)
        self.num_expert_groups = 1  # V4.1 routes without expert groups
        self.num_logical_experts = self.num_routed_experts = placement.logical
        self.num_physical_experts = placement.physical
        self.num_local_physical_experts = placement.local
        self.num_redundant_experts = placement.physical - placement.logical
        self.num_shared_experts = self.args.n_shared_experts

    def update_physical_experts_metadata(
        self, num_physical_experts: int, num_local_physical_experts: int
    ) -> None:
        """Called when vLLM resizes the EP group (elastic EP), which this model does not
        support: its expert tensors are sized at load."""
        if (num_physical_experts, num_local_physical_experts) != (
            self.num_physical_experts,
            self.num_local_physical_experts,
        ):
            raise ValueError(
                "vllm-deepinfer's V4.1 does not support elastic expert "
                "parallelism (the number of experts per rank changed)"
            )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds=None,
        **kwargs,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states)

    def draft(
        self,
        anchors: torch.Tensor,
        anchor_positions: torch.Tensor,
        requests: torch.Tensor,
        size: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """DSpark's greedy draft tokens and confidences [B, size] for the requests (rows
        of the last step) whose anchor token sits at `anchor_positions`; runs after the
        target's step, which wrote the stages' context."""
        draft = self.model.draft
        replay_start = draft.step_metadata[0].replay_start.to(anchors.device)
        ids, positions = block_inputs(
            anchors, anchor_positions, size, self.args.dspark_noise_token_id
        )
        b, n = ids.shape
        draft.block = DraftBlock(positions, requests, replay_start[requests])
        try:
            hidden, normed = self._draft_stages(ids.flatten(), positions.flatten())
        finally:
            draft.block = None
        base = self.compute_logits(normed)
        return markov_draft(
            base.view(b, n, -1),
            hidden.view(b, n, -1),
            anchors,
            draft.markov_embed,
            draft.markov_head,
            draft.confidence,
        )

    def warm_up_draft(self, size: int) -> None:
        """Runs the draft stages once on dummy blocks (no caches bound: their attention
        gives zeros), so that vLLM compiles them in its warm-up, not at the first draft."""
        if self.model.draft is None:
            return
        requests = 2  # a block count compiling does not specialize on (0 and 1 it does)
        ids = torch.zeros(requests * size, dtype=torch.int64, device=self.lm_head.weight.device)
        positions = torch.arange(size, device=ids.device).repeat(requests)
        self._draft_stages(ids, positions)

    def _draft_stages(
        self, ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The compiled stages on the blocks' flat ids and positions, in a forward context
        of their own (their layer ops find their modules through it)."""
        with set_forward_context(None, self.model.vllm_config):
            return self.model.draft(self.model.embed(ids), positions)

    @staticmethod
    def param_name(checkpoint_name: str) -> str:
        """Where a DeepSeek-native tensor lives in this module tree (experts excluded)."""
        if checkpoint_name == "head.weight":
            return "lm_head.weight"
        for old, new in _RENAMES:
            if checkpoint_name.endswith(old):
                return "model." + checkpoint_name[: -len(old)] + new
        if checkpoint_name.endswith(".scale"):  # a linear's, as vLLM's linear layers name it
            return "model." + checkpoint_name[: -len(".scale")] + ".weight_scale"
        return "model." + checkpoint_name

    @staticmethod
    def row_block(checkpoint_name: str) -> int | None:
        """Which row block of its parameter a tensor fills (None: the whole of it)."""
        for old, (_, block) in _ROW_BLOCKS.items():
            if checkpoint_name.endswith(old):
                return block
        return None

    def _draft_name(self, checkpoint_name: str) -> str:
        """`mtp.{s}.X` as the draft module names it: stage s's block tensors under
        `draft.layers.{s}`, the combiner and heads at draft level."""
        _, stage, rest = checkpoint_name.split(".", 2)
        if rest in _DRAFT_HEADS:
            return "draft." + _DRAFT_HEADS[rest]
        return f"draft.layers.{stage}.{rest}"

    def vision_parameters(self) -> dict[str, nn.Parameter]:
        """The vision path's parameters, named as the checkpoint names them: none in the
        text model (vision_language.py has them)."""
        return {}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads DeepSeek-native tensors (bf16 or the release's MXFP8/MXFP4). DSpark stages
        load when speculative decoding uses them; the vision tower when the model has
        one built (vision-language class, images allowed)."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        text = not self.encoder_only
        with_draft = text and self.model.draft is not None
        vision = self.vision_parameters()
        layout = backbone_layout(self.args, quantized=True) if text else {}
        if with_draft:
            layout |= dspark_layout(self.args, quantized=True)
        if vision:
            layout |= vision_layout(self.args)
        skipped_vision = 0

        def read():
            nonlocal skipped_vision
            for name, tensor in weights:
                if is_vision(name) and not vision:
                    skipped_vision += 1
                elif is_vision(name) or (text and (is_backbone(name) or with_draft)):
                    yield name, tensor

        def kept_as_stored(name: str) -> bool:
            """Whether the model holds quantized checkpoint tensor `name` as stored."""
            if ".engram.embed." in name:
                return True  # mapped from the file, decoded as looked up
            if name.startswith("mtp."):
                name = self._draft_name(name)
            if ".ffn.experts." in name:
                return modules[f"model.{name.rsplit('.', 3)[0]}"].method.quantized
            return self.param_name(scale_name(name)) in params

        loaded: set[str] = set()
        for checkpoint_name, tensor in checked(read(), layout, kept_as_stored):
            name = checkpoint_name
            if is_vision(name):
                param = vision[name]
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                loaded.add(name)
                continue
            if name.startswith("mtp."):
                name = self._draft_name(name)
            values, scale = tensor if isinstance(tensor, Stored) else (tensor, None)
            if ".engram.embed." in name:
                engram = modules[f"model.{name.rsplit('.', 2)[0]}"]
                engram.map_table(self.checkpoint_dir, checkpoint_name, scaled=scale is not None)
                continue
            if ".ffn.experts." in name:
                # Each rank keeps its share (its physical experts, or its width of each).
                prefix, expert, which, _ = name.rsplit(".", 3)
                experts = modules[f"model.{prefix}"]
                experts.load(int(expert), which, values, scale)
                loaded.update(f"model.{prefix}.{p}" for p, _ in experts.named_parameters())
                continue
            targets = [(self.param_name(name), values)]
            if scale is not None:
                targets.append((self.param_name(scale_name(name)), scale))
            block = self.row_block(name)
            for target, value in targets:
                param = params[target]
                if block is None:
                    getattr(param, "weight_loader", default_weight_loader)(param, value)
                else:
                    rows = value.shape[0]
                    param.data.narrow(0, block * rows, rows).copy_(value)
                loaded.add(target)
        if skipped_vision:
            logger.info(
                "Skipped %d vision-tower tensors: images are off (the image limit "
                "is 0, or the checkpoint has no vision tower)",
                skipped_vision,
            )
        if not text:
            logger.info(
                "Encoder-only instance: loaded the vision tower's %d tensors, not "
                "the language model",
                len(loaded),
            )
        elif self.args.engram_layer_ids:
            self.model.prepare_engram(self.tokenizer_dir)
        return loaded
