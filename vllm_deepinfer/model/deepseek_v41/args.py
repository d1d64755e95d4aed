"""V4.1 hyper-parameters read from the (flattened) HF config, checked for consistency.

Both the vLLM model and the reference forward take their structure from here: which
layers compress, which own caches, where top-k and Engram live.
"""

from __future__ import annotations

from dataclasses import dataclass, field

IMAGE_TOKEN_ID = 129264
"""The release tokenizer's image placeholder: every position of an image span carries it.
Engram treats exactly this id as dead (zero gate, n-grams padded through it)."""
VISION_ROUTED_IDS = range(IMAGE_TOKEN_ID, IMAGE_TOKEN_ID + 5)
"""Ids the vision-language MoE routes with `bias_vl` instead of `bias`: upstream tests a
span of five ids from the image token, not the image token alone."""

# The vision tower's sizes, under the names vLLM's DeepseekV41Config flattens
# `vision_config` to: they shape the checkpoint layout (vision_language.py builds the
# tower from vLLM's config itself).
VISION_KEYS = (
    "vision_n_layers",
    "vision_dim",
    "vision_n_heads",
    "vision_inter_dim",
    "vision_patch_size",
    "vision_downsample_ratio",
)


DSPARK_KEYS = (
    "dspark_block_size",
    "dspark_noise_token_id",
    "dspark_target_layer_ids",
    "dspark_markov_rank",
    "dspark_n_routed_experts",
    "dspark_num_experts_per_tok",
)


class V41ConfigError(ValueError):
    """The checkpoint's config contradicts itself or the V4.1 architecture."""


@dataclass(frozen=True)
class V41Args:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    sliding_window: int
    compress_ratios: tuple[int, ...]
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    candidate_source_layer_id: int
    candidate_topk_blocks: int
    candidate_block_size: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rope_theta: float
    compress_rope_theta: float
    rope_scaling: dict
    max_position_embeddings: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    swiglu_limit: float
    engram_layer_ids: tuple[int, ...]
    engram_max_ngram_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_vocab_size: int
    engram_compressed_vocab_size: int
    engram_pad_token_id: int
    engram_num_embeddings: tuple[int, ...]
    rms_norm_eps: float
    num_nextn_predict_layers: int = 0
    dspark: dict = field(default_factory=dict)
    vision: dict = field(default_factory=dict)

    @property
    def vision_language(self) -> bool:
        """The release's vision-language variant: a vision tower beside the text model."""
        return self.vision.get("vision_n_layers", 0) > 0

    # --- layer topology -------------------------------------------------------------
    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer] if layer < len(self.compress_ratios) else 0

    def kv_source(self, layer: int) -> int | None:
        """Nearest kv source at or below a compressed layer (None for SWA-only layers)."""
        if self.ratio(layer) == 0:
            return None
        return max(s for s in self.kv_source_layer_ids if s <= layer)

    def index_source(self, layer: int) -> int | None:
        """The layer whose top-k a compressed layer uses."""
        if self.ratio(layer) == 0:
            return None
        return max(s for s in self.index_source_layer_ids if s <= layer)

    def reads_candidates(self, layer: int) -> bool:
        return (
            self.candidate_source_layer_id >= 0
            and layer in self.index_source_layer_ids
            and layer > self.candidate_source_layer_id
        )

    @property
    def decoder_replay_cut(self) -> int | None:
        """The last kv source, where decoder-side replay can start: there must be layers
        after it, and none of them may need rows it trims (Engram's history, candidate
        blocks of an earlier candidate source). None where it cannot."""
        cut = max(self.kv_source_layer_ids)
        if cut >= self.num_hidden_layers - 1 or any(e >= cut for e in self.engram_layer_ids):
            return None
        if 0 <= self.candidate_source_layer_id < cut:
            return None
        return cut

    @property
    def engram_ngram_orders(self) -> int:
        return self.engram_max_ngram_size - 1

    @property
    def engram_columns(self) -> int:
        return self.engram_ngram_orders * self.engram_n_heads

    # --- DSpark draft stages (mtp.*) ---------------------------------------------------
    @property
    def dspark_stages(self) -> int:
        """How many DSpark stages the checkpoint carries (0: none, or no DSpark config)."""
        return self.num_nextn_predict_layers if self.dspark else 0

    @property
    def dspark_block_size(self) -> int:
        return self.dspark["dspark_block_size"]

    @property
    def dspark_noise_token_id(self) -> int:
        return self.dspark["dspark_noise_token_id"]

    @property
    def dspark_targets(self) -> tuple[int, ...]:
        """Target layers whose entry streams feed the draft (sorted, as upstream keeps them)."""
        return tuple(sorted(self.dspark["dspark_target_layer_ids"]))

    # --- construction -----------------------------------------------------------------
    @classmethod
    def from_release_config(cls, config: dict) -> V41Args:
        """From a release `config.json`, flattened the way vLLM flattens it for the engine
        (text fields as they are, vision fields as vision_*)."""
        from vllm.transformers_utils.configs.deepseek_v41 import DeepseekV41Config

        return cls.from_hf_config(DeepseekV41Config(**config))

    @classmethod
    def from_hf_config(cls, cfg) -> V41Args:
        def get(name, default=None):
            value = getattr(cfg, name, default)
            if value is None and default is None:
                raise V41ConfigError(f"config is missing `{name}`")
            return value

        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        args = cls(
            vocab_size=get("vocab_size"),
            hidden_size=get("hidden_size"),
            num_hidden_layers=get("num_hidden_layers"),
            num_attention_heads=get("num_attention_heads"),
            head_dim=get("head_dim"),
            qk_rope_head_dim=get("qk_rope_head_dim"),
            q_lora_rank=get("q_lora_rank"),
            o_lora_rank=get("o_lora_rank"),
            o_groups=get("o_groups"),
            sliding_window=get("sliding_window"),
            compress_ratios=tuple(get("compress_ratios")),
            kv_source_layer_ids=tuple(get("kv_source_layer_ids")),
            index_source_layer_ids=tuple(get("index_source_layer_ids")),
            candidate_source_layer_id=get("candidate_source_layer_id", -1),
            candidate_topk_blocks=get("candidate_topk_blocks", 0),
            candidate_block_size=get("candidate_block_size", 0),
            index_n_heads=get("index_n_heads"),
            index_head_dim=get("index_head_dim"),
            index_topk=get("index_topk"),
            rope_theta=float(get("rope_theta")),
            compress_rope_theta=float(get("compress_rope_theta")),
            rope_scaling=dict(rope),
            max_position_embeddings=get("max_position_embeddings"),
            hc_mult=get("hc_mult"),
            hc_sinkhorn_iters=get("hc_sinkhorn_iters"),
            hc_eps=float(get("hc_eps")),
            n_routed_experts=get("n_routed_experts"),
            num_experts_per_tok=get("num_experts_per_tok"),
            n_shared_experts=get("n_shared_experts"),
            moe_intermediate_size=get("moe_intermediate_size"),
            routed_scaling_factor=float(get("routed_scaling_factor")),
            swiglu_limit=float(get("swiglu_limit")),
            engram_layer_ids=tuple(get("engram_layer_ids", ())),
            engram_max_ngram_size=get("engram_max_ngram_size", 0),
            engram_n_heads=get("engram_n_heads", 0),
            engram_head_dim=get("engram_head_dim", 0),
            engram_vocab_size=get("engram_vocab_size", 0),
            engram_compressed_vocab_size=get("engram_compressed_vocab_size", 0),
            engram_pad_token_id=get("engram_pad_token_id", 0),
            engram_num_embeddings=tuple(get("engram_num_embeddings", ())),
            rms_norm_eps=float(get("rms_norm_eps")),
            num_nextn_predict_layers=getattr(cfg, "num_nextn_predict_layers", 0) or 0,
            dspark={k: getattr(cfg, k) for k in DSPARK_KEYS if hasattr(cfg, k)},
            vision={k: getattr(cfg, k) for k in VISION_KEYS if hasattr(cfg, k)},
        )
        args.validate()
        return args

    def validate(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise V41ConfigError(message)

        n = self.num_hidden_layers
        need(
            len(self.compress_ratios) == n,
            f"compress_ratios has {len(self.compress_ratios)} entries for {n} layers",
        )
        need(
            all(r in (0, 1, 2) for r in self.compress_ratios),
            f"compress_ratios may only hold 0, 1 or 2, got {sorted(set(self.compress_ratios))}",
        )
        need(
            self.qk_rope_head_dim % 2 == 0 and 0 < self.qk_rope_head_dim <= self.head_dim,
            f"qk_rope_head_dim {self.qk_rope_head_dim} must be even and fit in head_dim",
        )
        need(
            self.num_attention_heads % self.o_groups == 0,
            f"num_attention_heads {self.num_attention_heads} is not divisible by "
            f"o_groups {self.o_groups}",
        )
        for s in self.kv_source_layer_ids:
            need(0 <= s < n, f"kv source {s} is not a backbone layer")
            need(
                self.ratio(s) > 0,
                f"kv source layer {s} has compress ratio 0; a kv source must compress",
            )
        for s in self.index_source_layer_ids:
            need(
                0 <= s < n and self.ratio(s) > 0,
                f"index source {s} must be a compressed backbone layer",
            )
        for layer in range(n):
            if self.ratio(layer) == 0:
                continue
            need(
                any(s <= layer for s in self.kv_source_layer_ids),
                f"compressed layer {layer} has no kv source at or below it",
            )
            need(
                any(s <= layer for s in self.index_source_layer_ids),
                f"compressed layer {layer} has no index source at or below it",
            )
            kv, idx = self.kv_source(layer), self.index_source(layer)
            need(
                self.ratio(kv) == self.ratio(layer),
                f"layer {layer} (ratio {self.ratio(layer)}) reads kv source {kv} of ratio "
                f"{self.ratio(kv)}",
            )
            need(
                self.kv_source(idx) == kv,
                f"layer {layer} reuses the top-k of layer {idx}, which indexes kv source "
                f"{self.kv_source(idx)}, not its own kv source {kv}",
            )
        if self.candidate_source_layer_id >= 0:
            c = self.candidate_source_layer_id
            need(
                c in self.index_source_layer_ids and c in self.kv_source_layer_ids,
                f"candidate source {c} must be a kv source and an index source",
            )
            need(
                self.candidate_topk_blocks > 0 and self.candidate_block_size > 0,
                "candidate_topk_blocks and candidate_block_size must be positive",
            )
            need(
                self.candidate_topk_blocks * self.candidate_block_size >= self.index_topk,
                "candidate blocks must cover at least index_topk positions",
            )
        if self.engram_layer_ids:
            need(
                all(0 <= e < n for e in self.engram_layer_ids),
                f"engram_layer_ids {self.engram_layer_ids} name layers outside the backbone",
            )
            need(
                0 not in self.engram_layer_ids,
                "engram_layer_ids may not hold layer 0: V4.1 applies Engram after the previous "
                "layer's post-mix, which layer 0 does not have (upstream skips it there)",
            )
            need(self.engram_max_ngram_size >= 2, "engram_max_ngram_size must be at least 2")
            need(
                len(self.engram_num_embeddings) == len(self.engram_layer_ids),
                "engram_num_embeddings needs one entry per Engram layer",
            )
            need(self.engram_head_dim % 32 == 0, "engram_head_dim must be a multiple of 32")
        need(
            self.num_experts_per_tok <= self.n_routed_experts,
            "num_experts_per_tok exceeds n_routed_experts",
        )
        if self.dspark_stages:
            d = self.dspark
            missing = [k for k in DSPARK_KEYS if k not in d]
            need(not missing, f"DSpark config is missing {', '.join(missing)}")
            targets = d["dspark_target_layer_ids"]
            need(
                len(targets) > 0
                and len(set(targets)) == len(targets)
                and all(0 <= t < n for t in targets),
                f"dspark_target_layer_ids {list(targets)} must be distinct backbone layers",
            )
            need(self.dspark_block_size >= 1, "dspark_block_size must be at least 1")
            need(
                0 <= self.dspark_noise_token_id < self.vocab_size,
                f"dspark_noise_token_id {self.dspark_noise_token_id} is outside the vocabulary",
            )
            need(
                0 < d["dspark_num_experts_per_tok"] <= d["dspark_n_routed_experts"],
                "dspark_num_experts_per_tok must be in 1..dspark_n_routed_experts",
            )
