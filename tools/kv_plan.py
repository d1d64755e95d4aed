"""The KV-cache plan vLLM makes for the plugin's V4.1, and the engine settings that shape
it, as plain data: what a new vLLM release must leave as it was (`make test-next-vllm`
compares the newest vLLM's plan with the pinned one's), and what a cache layout costs.

The model is built on the meta device under the engine's own configuration (as vLLM's
CLI builds it, plugin hooks applied); its paged caches declare their specs, and vLLM's
own grouping turns them into cache groups. Nothing is allocated and nothing runs, so the
plan is made on a machine whose vLLM build has no kernels for it.

    python -m tools.kv_plan --model DIR [--json PATH]
    python -m tools.kv_plan --compare PINNED.json NEXT.json
    python -m tools.kv_plan --engine-refusal   # exit 3, printing `REFUSED: why`, where
                                               # vLLM configures no engine on this machine
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import re

PLANS = {
    "bounded_replay": ({}, {}),
    "exact": ({"DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": "0"}, {}),
    "fp8_kv": ({}, {"kv_cache_dtype": "fp8_ds_mla"}),
    "dspark": (
        {},
        {
            "speculative_config": {
                "method": "dspark",
                "num_speculative_tokens": 5,
                "enable_adaptive_verification": True,
            }
        },
    ),
}
"""The configurations compared: name -> (environment, engine arguments)."""
ENGINE_ARGS = {
    "dtype": "float32",
    "max_model_len": 4096,
    "max_num_seqs": 32,
    "max_num_batched_tokens": 64,
}
"""Small enough for the tiny checkpoint, and a budget under which a speculative decoding
reservation shows (64 tokens, 5 drafts)."""


def engine_refusal() -> str | None:
    """Why the installed vLLM refuses to configure any engine on this machine, or None
    where it does not: vLLM 0.34's CPU platform refuses on an x86 CPU without Triton's CPU
    backend ("vLLM on x86 CPUs requires Triton (triton-cpu)"), before any model is read.
    Tried with an engine configuration of no model."""
    from vllm.config import VllmConfig

    try:
        VllmConfig()
    except RuntimeError as exc:
        return str(exc)
    return None


def engine_config(model: str, **engine_args):
    """The engine configuration `vllm serve MODEL` builds (plugin registered, platform
    hooks run)."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, **engine_args).create_engine_config()


@contextlib.contextmanager
def _rope_cache_kept():
    """vLLM caches rotary embeddings by their parameters (`get_rope`) for the whole
    process: one built on the meta device here would be handed to the next model built
    in this process, whose forward then meets meta tensors. Those added inside are
    dropped."""
    from vllm.model_executor.layers import rotary_embedding

    cache = getattr(rotary_embedding, "_ROPE_DICT", None)
    before = dict(cache) if isinstance(cache, dict) else None
    try:
        yield
    finally:
        if before is not None:
            cache.clear()
            cache.update(before)


def kv_cache_specs(vllm_config) -> dict:
    """Every paged cache the plugin's V4.1 declares under `vllm_config` (name -> spec): the
    model built on the meta device in a one-process distributed group."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.model_executor.model_loader.utils import get_model_architecture
    from vllm.utils.network_utils import get_open_port

    from vllm_deepinfer.kv_cache.paged import PagedCache

    with set_current_vllm_config(vllm_config):
        if not model_parallel_is_initialized():
            init_distributed_environment(
                world_size=1,
                rank=0,
                local_rank=0,
                backend="gloo",
                distributed_init_method=f"tcp://127.0.0.1:{get_open_port()}",
            )
        ensure_model_parallel_initialized(1, 1)
        model_cls, _ = get_model_architecture(vllm_config.model_config)
        with torch.device("meta"), _rope_cache_kept():
            model_cls(vllm_config=vllm_config)
    caches = vllm_config.compilation_config.static_forward_context
    return {
        name: cache.get_kv_cache_spec(vllm_config)
        for name, cache in caches.items()
        if isinstance(cache, PagedCache)
    }


def _spec(spec) -> dict:
    """A spec's type, page size and fields; a group of several specs (vLLM's
    UniformTypeKVCacheSpecs) with each layer's."""
    import dataclasses

    def plain(value):
        if isinstance(value, dict):
            return {str(key): plain(item) for key, item in sorted(value.items())}
        if dataclasses.is_dataclass(value):
            return _spec(value)
        return value if isinstance(value, (int, float, bool, str, type(None))) else str(value)

    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    return {
        "type": type(spec).__name__,
        "page_size_bytes": spec.page_size_bytes,
        **{name: plain(value) for name, value in sorted(fields.items())},
    }


def _cache_groups(vllm_config, specs: dict) -> list:
    """vLLM's cache groups for `specs`: through the platform's KV cache config builder
    where this vLLM has one (it honours a model's own grouping), else its one grouping."""
    try:
        from vllm.v1.core.kv_cache_config_builder import get_kv_cache_config_builder
        from vllm.v1.core.kv_cache_planning import get_kv_cache_groups_from_builder
    except ImportError:
        from vllm.v1.core.kv_cache_utils import get_kv_cache_groups

        return get_kv_cache_groups(vllm_config, specs)
    return get_kv_cache_groups_from_builder(
        get_kv_cache_config_builder(vllm_config), vllm_config, specs
    )


def plan(model: str, environment: dict[str, str] | None = None, **engine_args) -> dict:
    """The engine settings that shape the KV cache and vLLM's cache groups for `model`."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )

    from vllm_deepinfer.envs import overridden

    with overridden(**(environment or {})):
        config = engine_config(model, **{**ENGINE_ARGS, **engine_args})
        specs = kv_cache_specs(config)
        # What the worker and the engine core do before the cache is allocated: the
        # platform's block size for the backends (where this vLLM has that step), then
        # one layout for every backend.
        update_block_size = getattr(current_platform, "update_block_size_for_backend", None)
        if update_block_size is not None:
            update_block_size(config)
        layouts = [
            layout.name
            for layout in get_supported_kv_cache_layouts(get_current_attn_backends(config))
        ]
        layout = resolve_kv_cache_layout(config, [layouts], list(specs.values()))
        groups = _cache_groups(config, specs)
    scheduler, spec = config.scheduler_config, config.speculative_config
    return {
        "engine": {
            "block_size": config.cache_config.block_size,
            "kv_cache_layout": layout.name,
            "cache_dtype": str(config.cache_config.cache_dtype),
            "prefix_caching": config.cache_config.enable_prefix_caching,
            "max_num_seqs": scheduler.max_num_seqs,
            "max_num_batched_tokens": scheduler.max_num_batched_tokens,
            "max_num_active_seqs": getattr(scheduler, "max_num_active_seqs", None),
            "async_scheduling": scheduler.async_scheduling,
            "scheduler_cls": scheduler.scheduler_cls and str(scheduler.scheduler_cls),
            "worker_cls": str(config.parallel_config.worker_cls),
            "speculative": None
            if spec is None
            else {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens},
        },
        "groups": [
            {"layers": sorted(group.layer_names), "spec": _spec(group.kv_cache_spec)}
            for group in groups
        ],
    }


def differences(pinned, other, path: str = "") -> tuple[list[str], list[str]]:
    """(changed, added or gone): values two plans give differently, and fields only one
    has (a field a release added to a spec class says nothing by itself; a changed value
    does)."""
    if isinstance(pinned, dict) and isinstance(other, dict):
        changed, unmatched = [], []
        for key in sorted(pinned.keys() | other.keys()):
            where = f"{path}.{key}" if path else key
            if key not in other or key not in pinned:
                side = "pinned" if key in pinned else "next"
                unmatched.append(f"{where}: only in the {side} plan")
                continue
            more = differences(pinned[key], other[key], where)
            changed += more[0]
            unmatched += more[1]
        return changed, unmatched
    if isinstance(pinned, list) and isinstance(other, list) and len(pinned) == len(other):
        changed, unmatched = [], []
        for i, (a, b) in enumerate(zip(pinned, other)):
            more = differences(a, b, f"{path}[{i}]")
            changed += more[0]
            unmatched += more[1]
        return changed, unmatched
    return ([] if pinned == other else [f"{path}: {pinned!r} -> {other!r}"]), []


def compare(pinned_path: str, next_path: str) -> int:
    with open(pinned_path) as f:
        pinned = json.load(f)
    with open(next_path) as f:
        other = json.load(f)
    changed, unmatched = differences(pinned, other)
    fields = collections.Counter(
        re.sub(r"^.*\.", "", line.split(":")[0]) + ":" + line.split(":", 1)[1] for line in unmatched
    )
    for field, places in sorted(fields.items()):
        print(f"  note: {field} ({places} places)")
    for line in changed:
        print(f"  CHANGED: {line}")
    print(
        f"engine configuration and KV-cache plan: {len(changed)} changed values, "
        f"{len(unmatched)} fields in one plan only"
    )
    return 1 if changed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a V4.1 checkpoint directory")
    parser.add_argument("--json", help="write the plans here (else to stdout)")
    parser.add_argument(
        "--compare",
        nargs=2,
        metavar=("PINNED", "NEXT"),
        help="compare two plan files; exit 1 where a value changed",
    )
    parser.add_argument(
        "--engine-refusal",
        action="store_true",
        help="exit 3, printing `REFUSED: <vLLM's reason>`, where the installed "
        "vLLM configures no engine on this machine; else exit 0",
    )
    args = parser.parse_args()
    if args.engine_refusal:
        refusal = engine_refusal()
        print(f"REFUSED: {refusal}" if refusal else "vLLM configures an engine here", flush=True)
        return 3 if refusal else 0
    if args.compare:
        return compare(*args.compare)
    if not args.model:
        parser.error("--model is required (or --compare)")
    plans = {
        name: plan(args.model, environment, **engine_args)
        for name, (environment, engine_args) in PLANS.items()
    }
    text = json.dumps(plans, indent=1, sort_keys=True)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
