"""Registration and configuration (the patches to vLLM: tests/patches/)."""

import re

import pytest

from helpers import logged_records, run_python
from vllm_deepinfer import envs
from vllm_deepinfer.model.deepseek_v41 import registration


@pytest.mark.unit
def test_register_is_idempotent_and_registers_the_plugin_model():
    from vllm import ModelRegistry

    from vllm_deepinfer.plugins import register

    register()
    register()
    model_cls = ModelRegistry._try_load_model_cls(registration.ARCH)
    assert model_cls.__module__ == "vllm_deepinfer.model.deepseek_v41.model"


@pytest.mark.engine
def test_choice_is_logged_once_through_vllms_logger_tree():
    """The line goes where vLLM sends its own logs (here: stderr), in vLLM's format; the
    plugin's loggers are not outside the `vllm` tree, where nothing would print them."""
    result = run_python(
        "from vllm.config.logging import LoggingConfig\n"
        "from vllm.logger import configure_logging\n"
        "configure_logging(LoggingConfig())  # as every vLLM process does\n"
        "from vllm_deepinfer.plugins import register\n"
        "register()\nregister()\n",
        VLLM_LOGGING_STREAM="ext://sys.stderr",
        NO_COLOR="1",
    )
    lines = [line for line in result.stderr.splitlines() if "DEEPINFER_MODEL_IMPL" in line]
    assert len(lines) == 1, result.stderr[-2000:]
    assert re.match(
        r"\(MainProcess pid=\d+\) INFO \d\d-\d\d \d\d:\d\d:\d\d "
        r"\[registration\.py:\d+\] DEEPINFER_MODEL_IMPL=auto: vllm-deepinfer "
        r"serves DeepseekV41ForCausalLM$",
        lines[0],
    ), lines[0]
    assert "DEEPINFER_MODEL_IMPL" not in result.stdout


@pytest.mark.unit
def test_deepinfer_settings_are_carried_to_ray_actors():
    """The DEEPINFER_ prefix joins vLLM's extra prefixes for Ray actors, once, after the
    user's own (tests/distributed/test_ray.py: on a served Ray DP layout)."""
    from vllm import envs as vllm_envs

    assert envs.RAY_PREFIXES_VARIABLE in vllm_envs.environment_variables
    environ = {envs.RAY_PREFIXES_VARIABLE: "MYLIB_"}
    envs.carry_to_ray_actors(environ)
    envs.carry_to_ray_actors(environ)
    assert environ == {envs.RAY_PREFIXES_VARIABLE: "MYLIB_,DEEPINFER_"}
    environ = {}
    envs.carry_to_ray_actors(environ)
    assert environ == {envs.RAY_PREFIXES_VARIABLE: "DEEPINFER_"}


@pytest.mark.unit
def test_entry_point_is_installed():
    from importlib.metadata import entry_points

    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins["deepinfer"] == "vllm_deepinfer.plugins:register"


@pytest.mark.unit
@pytest.mark.parametrize(
    "requested,expected", [("auto", "deepinfer"), ("deepinfer", "deepinfer"), ("vllm", "vllm")]
)
def test_model_impl_choice_on_cpu(requested, expected):
    assert registration.resolve_impl(requested) == expected


@pytest.mark.engine
def test_model_impl_vllm_keeps_upstream_model():
    out = run_python(
        "from vllm import ModelRegistry\n"
        "from vllm_deepinfer.model.deepseek_v41.registration import register_deepseek_v41\n"
        "print(register_deepseek_v41())\n"
        "print(ModelRegistry.models['DeepseekV41ForCausalLM'].module_name)\n",
        DEEPINFER_MODEL_IMPL="vllm",
    )
    assert out.stdout.split() == ["vllm", "vllm.models.deepseek_v41"]


@pytest.mark.unit
def test_bad_setting_is_rejected_with_its_name():
    with pytest.raises(
        envs.ConfigError,
        match=r"DEEPINFER_MODEL_IMPL='gpu' is not valid; "
        r"use one of auto, deepinfer, vllm",
    ):
        envs.load({"DEEPINFER_MODEL_IMPL": "gpu"})
    assert envs.load({"DEEPINFER_MODEL_IMPL": " Auto "}).model_impl == "auto"


@pytest.mark.unit
def test_grammar_cache_dir_must_be_a_directory(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(envs.ConfigError, match="DEEPINFER_GRAMMAR_CACHE_DIR=.* is not a directory"):
        envs.load({"DEEPINFER_GRAMMAR_CACHE_DIR": str(not_a_dir)})
    assert envs.load({"DEEPINFER_GRAMMAR_CACHE_DIR": str(tmp_path)}).grammar_cache_dir == str(
        tmp_path
    )


@pytest.mark.unit
@pytest.mark.parametrize(
    "name,field",
    [
        ("DEEPINFER_GRAMMAR_CACHE", "grammar_cache"),
        ("DEEPINFER_ASYNC_SCHEDULING", "async_scheduling"),
    ],
)
def test_switches_default_on_and_take_on_off_1_0(name, field):
    assert getattr(envs.load({}), field) is True
    for value, expected in (("on", True), ("1", True), (" OFF ", False), ("0", False)):
        assert getattr(envs.load({name: value}), field) is expected
    with pytest.raises(
        envs.ConfigError,
        match=rf"{name}='yes' is not valid; "
        r"use one of on, 1, off, 0",
    ):
        envs.load({name: "yes"})


@pytest.fixture
def structured_registration_log():
    """Records of the structured registration's logger at every level."""
    from vllm_deepinfer.serving import grammar_cache as structured_registration

    with logged_records(structured_registration.logger) as records:
        yield records


@pytest.mark.unit
def test_grammar_cache_off_skips_the_patch(monkeypatch, tmp_path, structured_registration_log):
    from vllm_deepinfer import patches
    from vllm_deepinfer.serving import grammar_cache as structured_registration

    applied = []
    monkeypatch.setattr(
        patches, "apply_patch", lambda name, **kwargs: applied.append((name, kwargs)) or True
    )
    monkeypatch.setattr(structured_registration, "_skip_logged", False)
    monkeypatch.setenv("DEEPINFER_GRAMMAR_CACHE_DIR", str(tmp_path))

    monkeypatch.setenv("DEEPINFER_GRAMMAR_CACHE", "off")
    assert structured_registration.register_grammar_cache() is False
    assert structured_registration.register_grammar_cache() is False
    assert applied == []
    assert [r.getMessage() for r in structured_registration_log] == [
        "DEEPINFER_GRAMMAR_CACHE=off: the grammar-cache patch is not applied; vLLM's xgrammar "
        "backend compiles every grammar in the engine"
    ]

    monkeypatch.setenv("DEEPINFER_GRAMMAR_CACHE", "on")
    assert structured_registration.register_grammar_cache() is True
    assert applied == [("xgrammar_grammar_cache", {"cache_dir": str(tmp_path)})]


@pytest.mark.engine
def test_grammar_cache_off_leaves_vllms_backend_in_a_fresh_process():
    """What vLLM calls in every process, register(), keeps the stock xgrammar backend."""
    code = (
        "from vllm_deepinfer.plugins import register\n"
        "register()\n"
        "from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend\n"
        "from vllm_deepinfer import patches\n"
        "print(XgrammarBackend.__post_init__.__module__, "
        "'xgrammar_grammar_cache' in patches.STATUS)\n"
    )
    assert run_python(code, DEEPINFER_GRAMMAR_CACHE="off").stdout.split() == [
        "vllm.v1.structured_output.backend_xgrammar",
        "False",
    ]
    assert run_python(code, DEEPINFER_GRAMMAR_CACHE="on").stdout.split() == [
        "vllm_deepinfer.patches.xgrammar_grammar_cache",
        "True",
    ]


@pytest.mark.engine  # a fresh interpreter importing vLLM
def test_the_platform_is_known_as_vllm_knows_it_and_the_cpu_build_without_importing_vllm():
    """`deepinfer serve` re-executes itself before importing vLLM where the package
    metadata says CPU build; the answer is vLLM's own, however it is reached."""
    run_python(
        "import sys\n"
        "from vllm_deepinfer.preload import _on_cpu_platform\n"
        "on_cpu, imported = _on_cpu_platform(), 'vllm' in sys.modules\n"
        "from vllm.platforms import current_platform\n"
        "assert on_cpu == current_platform.is_cpu(), on_cpu\n"
        "assert not (on_cpu and imported), 'vLLM imported to find its CPU build'\n"
    )
