"""The CPU worker's one line about compiling: vLLM's CPU worker compiles in its memory
profiling (its warm-up) and logs only where it saved the result."""

import logging
import os
from types import SimpleNamespace

import pytest

from helpers import without_model_runner_v1

if without_model_runner_v1():  # the plugin's CPU worker composes Model Runner V1's parts
    pytest.skip(without_model_runner_v1(), allow_module_level=True)

from vllm.config import CompilationMode  # noqa: E402
from vllm.v1.worker.cpu_worker import CPUWorker  # noqa: E402

from vllm_deepinfer.worker import cpu_worker  # noqa: E402
from vllm_deepinfer.worker.cpu_worker import DeepInferCPUWorker  # noqa: E402

pytestmark = pytest.mark.unit


@pytest.fixture
def lines(monkeypatch):
    records = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler, level = Collect(level=logging.DEBUG), cpu_worker.logger.level
    cpu_worker.logger.addHandler(handler)
    cpu_worker.logger.setLevel(logging.INFO)  # as vLLM's logging configuration has it
    yield records
    cpu_worker.logger.removeHandler(handler)
    cpu_worker.logger.setLevel(level)


@pytest.mark.parametrize(
    "compiled,saved,rank,expected",
    [
        (True, True, 0, "the next start with the same model and settings loads it"),
        (True, False, 0, "not saved to vLLM's compile cache: the next start compiles again"),
        (False, False, 0, None),  # loaded from the cache (vLLM says so) or eager
        (True, True, 1, None),  # one line per engine, not per worker
    ],
)
def test_a_compiling_start_says_how_long_and_what_the_next_start_does(
    compiled, saved, rank, expected, lines, monkeypatch
):
    from vllm.compilation.counter import compilation_counter

    def profile(self):
        compilation_counter.num_aot_compiles += compiled
        compilation_counter.num_aot_artifacts_saved += saved
        return 1234

    monkeypatch.setattr(compilation_counter, "num_aot_compiles", 0)
    monkeypatch.setattr(compilation_counter, "num_aot_artifacts_saved", 0)
    monkeypatch.setattr(CPUWorker, "determine_available_memory", profile)
    worker = object.__new__(DeepInferCPUWorker)
    worker.rank = rank
    worker.vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(architecture="DeepseekV41ForCausalLM"),
        compilation_config=SimpleNamespace(mode=CompilationMode.NONE),
    )
    assert worker.determine_available_memory() == 1234
    if expected is None:
        assert lines == []
    else:
        [line] = lines
        assert line.startswith("DeepseekV41ForCausalLM compiled in ") and expected in line


@pytest.mark.parametrize("mode", [CompilationMode.VLLM_COMPILE, CompilationMode.NONE])
@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("set_before", [None, "/somewhere/else"])
def test_the_vector_isa_check_runs_once_under_the_cache_root_before_compiling(
    mode, invariant, set_before, monkeypatch, tmp_path
):
    """A compiling start runs Inductor's vector-ISA check under vLLM's cache root (where
    the next process finds its test builds) before vLLM compiles, and leaves Inductor's
    cache dir as it was; an eager start (enforce-eager, or batch-invariant mode, which
    runs V4.1 eager) does not run it."""
    import vllm.envs
    from torch._inductor import cpu_vec_isa

    from vllm_deepinfer.determinism import batch_invariant

    monkeypatch.setattr(batch_invariant, "enabled", lambda: invariant)
    events = []
    monkeypatch.setattr(vllm.envs, "VLLM_CACHE_ROOT", str(tmp_path))
    if set_before is None:
        monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    else:
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", set_before)
    monkeypatch.setattr(
        cpu_vec_isa,
        "valid_vec_isa_list",
        lambda: events.append(("isa check", os.environ["TORCHINDUCTOR_CACHE_DIR"])),
    )
    monkeypatch.setattr(
        CPUWorker,
        "determine_available_memory",
        lambda self: events.append(("compile", os.environ.get("TORCHINDUCTOR_CACHE_DIR"))) or 1,
    )
    worker = object.__new__(DeepInferCPUWorker)
    worker.rank = 0
    worker.vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(architecture="DeepseekV41ForCausalLM"),
        compilation_config=SimpleNamespace(mode=mode),
    )
    worker.determine_available_memory()
    check = [("isa check", str(tmp_path / "deepinfer" / "inductor_isa"))]
    compiles = mode != CompilationMode.NONE and not invariant
    assert events == (check if compiles else []) + [("compile", set_before)]
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == set_before
