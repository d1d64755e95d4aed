"""Session fixtures: the embedded checkpoints are built once per test session, and vLLM
engines are shared by the tests of a module (each start costs ~20 s). Shared helpers are
in helpers.py.

Markers: `unit` (in-process, no engine, no server; `make test-fast`), `engine` (a
vllm.LLM, a model build or a fresh vLLM process: 10-25 s each), `server` (a live
`deepinfer serve`), `gpu` (needs CUDA; skipped without).
Every test carries one of them (module-level `pytestmark` or per test). Beside them,
`model_runner_v1` (skipped where vLLM has no Model Runner V1) and `engine_config` (skipped
where vLLM refuses to configure an engine on this machine) say what a newer vLLM may lack
(`make test-next-vllm` lists what it skips). `slow` is an extra marker too: the full
trained pair and anything else too slow for the default run (`make test` deselects them;
skipped unless `-m` names `slow` or `--run-slow` is given, as `make test-all` does)."""

import os
import tempfile

# Engines run in this process: faster to start, and the tests can read their results
# directly. The serving tests start real multi-process servers instead.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# Compiled grammars go to a cache of this test session only.
os.environ.setdefault("DEEPINFER_GRAMMAR_CACHE_DIR", tempfile.mkdtemp(prefix="grammars-"))

import pytest  # noqa: E402

from helpers import EARLY_RUNS, ROOT, demo_run, serve, training_run  # noqa: E402

MARKERS = ("unit", "engine", "server", "gpu")


def pytest_addoption(parser):
    parser.addoption(
        "--run-slow", action="store_true", help="also run the tests marked slow (make test-all)"
    )


def pytest_collection_modifyitems(config, items):
    import torch

    unmarked = [
        item.nodeid for item in items if not any(item.get_closest_marker(m) for m in MARKERS)
    ]
    if unmarked:
        raise pytest.UsageError(f"tests without a unit/engine/server/gpu marker: {unmarked}")
    mixed = [
        item.nodeid
        for item in items
        if item.get_closest_marker("unit") and any(item.get_closest_marker(m) for m in MARKERS[1:])
    ]
    if mixed:
        raise pytest.UsageError(f"tests marked unit and engine/server/gpu: {mixed}")
    # The full pair trains for many minutes: only tests that say they are slow get it.
    unslow = [
        item.nodeid
        for item in items
        if "full_trained_pair" in getattr(item, "fixturenames", ())
        and not item.get_closest_marker("slow")
    ]
    if unslow:
        raise pytest.UsageError(f"tests on the full trained pair not marked slow: {unslow}")
    run_slow = config.getoption("--run-slow") or "slow" in (config.option.markexpr or "")
    for item in items:
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if item.get_closest_marker("slow") and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow: make test-all, --run-slow or -m slow"))
    _skip_what_this_vllm_lacks(items)


def _skip_what_this_vllm_lacks(items) -> None:
    """Tests of Model Runner V1 features where vLLM has no such runner, and tests that
    configure an engine where vLLM refuses to on this machine, are skipped, naming why."""
    from helpers import without_model_runner_v1
    from vllm_deepinfer import vllm_support

    no_runner_v1 = without_model_runner_v1()
    for item in items if no_runner_v1 else ():
        if item.get_closest_marker("model_runner_v1"):
            item.add_marker(pytest.mark.skip(reason=no_runner_v1))
    configuring = [item for item in items if item.get_closest_marker("engine_config")]
    if configuring:
        from tools.kv_plan import engine_refusal

        refusal = engine_refusal()
        for item in configuring if refusal else ():
            item.add_marker(
                pytest.mark.skip(
                    reason=f"vLLM {vllm_support.installed_vllm()} configures no engine on this "
                    f"machine: {refusal}"
                )
            )


def _checkpoint(tmp_path_factory, name: str, **variant) -> str:
    """A tiny checkpoint of this session. fixtures.tiny imports vLLM (about 8 s): imported
    here rather than at the top, so pytest-xdist's controller (make test-fast), which runs
    no test, does not pay it."""
    from fixtures.tiny import write_checkpoint

    return write_checkpoint(str(tmp_path_factory.mktemp("ckpt") / name), **variant)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> str:
    return _checkpoint(tmp_path_factory, "tiny-v41")


@pytest.fixture(scope="session")
def trained_pair() -> str:
    """The quick trained target and DSpark draft (fixtures/trained.py's "quick" recipe,
    drafts accepted on the predictable spans), in checkpoints/: trained here once (well
    under a minute) unless it holds that recipe's finished checkpoint."""
    return _trained_pair("quick")


@pytest.fixture(scope="session")
def full_trained_pair() -> str:
    """The full trained pair (`make trained-pair`'s directory, the benchmark's), for tests
    marked slow: trained here once (about ten minutes) unless it holds the full recipe's
    finished checkpoint."""
    return _trained_pair("full")


def _trained_pair(recipe: str) -> str:
    """The recipe's pair, trained first (helpers.training_run: in a fresh process) where its
    directory lacks it."""
    from fixtures.trained import checkpoint_dir, finished_report

    out = checkpoint_dir(recipe, ROOT)
    if finished_report(out, recipe) is None:
        run = EARLY_RUNS.pop(f"train-{recipe}", None) or training_run(recipe, out)
        trained = run.result(timeout=TRAINING_TIMEOUT_S)
        if trained.returncode != 0:
            pytest.fail(f"training the {recipe} pair failed:\n{trained.stderr[-4000:]}")
    return out


TRAINING_TIMEOUT_S = 3600
DEMO_TEST = "tests/examples/test_offline_demo.py"


def pytest_collection_finish(session):
    """The long subprocesses the selected tests wait on start now, beside the tests before
    them: `make demo`'s first compile and the quick pair's training where its directory
    lacks it."""
    from fixtures.trained import checkpoint_dir, finished_report

    if session.config.option.collectonly:
        return
    if any(item.nodeid.startswith(DEMO_TEST) for item in session.items):
        EARLY_RUNS["demo"] = demo_run(beside_tests=True)
    out = checkpoint_dir("quick", ROOT)
    if any("trained_pair" in item.fixturenames for item in session.items) and (
        finished_report(out, "quick") is None
    ):
        EARLY_RUNS["train-quick"] = training_run("quick", out, beside_tests=True)


def pytest_sessionfinish(session):
    """Early runs no test took (it failed or was interrupted first) are stopped."""
    while EARLY_RUNS:
        EARLY_RUNS.popitem()[1].stop()


@pytest.fixture(scope="session")
def quantized_checkpoint(tmp_path_factory) -> str:
    return _checkpoint(tmp_path_factory, "tiny-v41-mx", quantized=True)


@pytest.fixture(scope="session")
def vision_checkpoint(tmp_path_factory) -> str:
    """The vision-language variant the release is: vision tower and bias_vl."""
    return _checkpoint(tmp_path_factory, "tiny-v41-vl", vision=True)


@pytest.fixture(scope="session")
def quantized_vision_checkpoint(tmp_path_factory) -> str:
    return _checkpoint(tmp_path_factory, "tiny-v41-vl-mx", quantized=True, vision=True)


@pytest.fixture(scope="session")
def oa(api_server):
    """The `openai` client on the shared server."""
    import openai

    return openai.OpenAI(base_url=f"{api_server}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="session")
def claude(api_server):
    """The `anthropic` client on the shared server."""
    import anthropic

    return anthropic.Anthropic(base_url=api_server, api_key="unused", max_retries=0)


@pytest.fixture(scope="session")
def api_server(vision_checkpoint, tmp_path_factory):
    """The vision-language tiny checkpoint (the release's form); shared by the serving
    tests. A 256-token prefill budget chunks any longer prompt; at most 3 images of at
    most 1 megapixel per request, 2 megapixels and 4 MB together."""
    with serve(
        vision_checkpoint,
        tmp_path_factory.mktemp("serve"),
        "--reasoning-parser",
        "deepseek_v41",
        "--max-num-batched-tokens",
        "256",
        "--limit-mm-per-prompt",
        '{"image": 3}',
        env={
            "DEEPINFER_MAX_IMAGE_PIXELS": "1000000",
            "DEEPINFER_MAX_REQUEST_IMAGE_PIXELS": "2000000",
            "DEEPINFER_MAX_REQUEST_IMAGE_BYTES": "4000000",
        },
    ) as base:
        yield base
