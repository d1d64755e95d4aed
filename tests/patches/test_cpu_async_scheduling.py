"""Patch cpu_async_scheduling: the plugin's V4.1 runs with async scheduling on the CPU
(vLLM's CPU platform forces it off for every model), unless DEEPINFER_ASYNC_SCHEDULING,
the user or vLLM's own checks say off; other models keep the platform's choice.

Unit tests drive the decision and the wrapper around a stand-in of the platform hook; the
engine tests build real configs, and generate the same batch with async scheduling on and
off (multiprocess executor, as `vllm serve` runs): same tokens, same logprobs."""

import inspect
import json
import re
from types import SimpleNamespace

import pytest

from helpers import close_llm, generate, logged_records, make_llm, random_prompts, run_python
from vllm_deepinfer import patches
from vllm_deepinfer.patches import cpu_async_scheduling, cpu_platform_config

V41 = "DeepseekV41ForCausalLM"


def serves_v41(model_config) -> bool:
    return model_config.architecture == V41


@pytest.fixture
def platform(monkeypatch):
    """CpuPlatform with upstream's own check_and_update_config for this test (whatever
    this process had is put back afterwards)."""
    from vllm.platforms.cpu import CpuPlatform

    upstream = inspect.unwrap(CpuPlatform.__dict__["check_and_update_config"].__func__)
    monkeypatch.setattr(CpuPlatform, "check_and_update_config", classmethod(upstream))
    monkeypatch.delenv("DEEPINFER_ASYNC_SCHEDULING", raising=False)
    return CpuPlatform


@pytest.fixture
def decision_log():
    """Records of the patch's logger at every level."""
    with logged_records(cpu_async_scheduling.logger) as records:
        yield records


# --- the decision ---------------------------------------------------------------------------


def executors():
    from vllm.v1.executor.abstract import Executor
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    return MultiprocExecutor, Executor  # Executor itself: an executor without async support


@pytest.mark.unit
@pytest.mark.parametrize(
    "requested,vllm_choice,speculative,executor,on,why",
    [
        (True, True, None, 0, True, "DEEPINFER_ASYNC_SCHEDULING=on, MultiprocExecutor"),
        (False, True, None, 0, False, "DEEPINFER_ASYNC_SCHEDULING=off"),
        (True, False, None, 0, False, "--no-async-scheduling / async_scheduling=False"),
        (True, True, "eagle3", 0, False, "speculative decoding (eagle3) is not verified"),
        (True, True, None, 1, False, "the Executor executor does not support it"),
        (False, False, "ngram", 1, False, "DEEPINFER_ASYNC_SCHEDULING=off"),  # first reason wins
    ],
)
def test_decision(requested, vllm_choice, speculative, executor, on, why):
    decided, reason = cpu_async_scheduling.decide(
        requested, vllm_choice, speculative, executors()[executor]
    )
    assert decided is on and why in reason


# --- the wrapper, around a stand-in of the platform hook -------------------------------------


def _forces_async_off(cls, vllm_config):
    vllm_config.scheduler_config.async_scheduling = False


def _leaves_async_alone(cls, vllm_config):
    vllm_config.scheduler_config.block_size = 16


def config(architecture: str, async_scheduling, speculative_method=None, executor="mp"):
    """The fields the wrapper reads, after VllmConfig.__post_init__ decided."""
    return SimpleNamespace(
        model_config=SimpleNamespace(architecture=architecture),
        scheduler_config=SimpleNamespace(async_scheduling=async_scheduling),
        speculative_config=(
            SimpleNamespace(method=speculative_method) if speculative_method else None
        ),
        parallel_config=SimpleNamespace(distributed_executor_backend=executor),
    )


@pytest.mark.unit
def test_v41_gets_vllms_decision_back_and_other_models_keep_the_platforms(
    platform, monkeypatch, decision_log
):
    monkeypatch.setattr(platform, "check_and_update_config", classmethod(_forces_async_off))
    assert cpu_async_scheduling.apply(serves_model=serves_v41)
    cases = {
        "v41": config(V41, True),
        "v41, user said no": config(V41, False),
        "v41, uni executor": config(V41, True, executor="uni"),
        "v41, eagle3": config(V41, True, speculative_method="eagle3"),
        "llama": config("LlamaForCausalLM", True),
    }
    for vllm_config in cases.values():
        platform.check_and_update_config(vllm_config)
    assert {case: c.scheduler_config.async_scheduling for case, c in cases.items()} == {
        "v41": True,
        "v41, user said no": False,
        "v41, uni executor": True,
        "v41, eagle3": False,
        "llama": False,
    }
    assert [r.getMessage().split(":")[0] for r in decision_log] == [  # one line per V4.1 config
        f"Async scheduling {state} for {V41}" for state in ("on", "off", "on", "off")
    ]

    monkeypatch.setenv("DEEPINFER_ASYNC_SCHEDULING", "off")
    off = config(V41, True)
    platform.check_and_update_config(off)
    assert off.scheduler_config.async_scheduling is False
    assert (
        decision_log[-1].getMessage()
        == f"Async scheduling off for {V41}: DEEPINFER_ASYNC_SCHEDULING=off"
    )


@pytest.mark.unit
@pytest.mark.model_runner_v1  # apply_patch tries the patch only where vLLM has that runner
def test_not_needed_when_the_platform_stops_forcing_async_off(platform, monkeypatch):
    replacement = classmethod(_leaves_async_alone)
    monkeypatch.setattr(platform, "check_and_update_config", replacement)
    assert cpu_async_scheduling.apply(serves_model=serves_v41) is False
    assert platform.__dict__["check_and_update_config"] is replacement  # nothing installed
    assert patches.apply_patch("cpu_async_scheduling", serves_model=serves_v41) is True
    assert patches.STATUS["cpu_async_scheduling"] == patches.Outcome(patches.NOT_NEEDED)


@pytest.mark.unit
@pytest.mark.parametrize(
    "order",
    [(cpu_platform_config, cpu_async_scheduling), (cpu_async_scheduling, cpu_platform_config)],
)
def test_both_cpu_platform_wrappers_install_once_in_either_order(platform, order):
    """register() runs many times per process; neither wrapper hides the other."""
    for _ in range(3):
        for patch in order:
            assert patch.apply(serves_model=serves_v41)
    chain, function = [], platform.check_and_update_config.__func__
    while function is not None:
        chain.append(function)
        function = getattr(function, "__wrapped__", None)
    assert len(chain) == 3  # two wrappers and upstream's function
    assert chain[-1] is inspect.unwrap(chain[0])


# --- real configs ---------------------------------------------------------------------------

_DECISIONS = """
import json, os
from vllm.engine.arg_utils import EngineArgs
NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
results = {}
for case, env, options in (("default", "on", {}), ("env off", "off", {}),
                           ("user off", "on", {"async_scheduling": False}),
                           ("ngram", "on", {"speculative_config": NGRAM})):
    os.environ["DEEPINFER_ASYNC_SCHEDULING"] = env
    c = EngineArgs(model=MODEL, max_model_len=512, **options).create_engine_config()
    results[case] = [c.scheduler_config.async_scheduling,
                     c.parallel_config.distributed_executor_backend]
print("RESULT " + json.dumps(results))
"""


@pytest.mark.engine
def test_decisions_on_real_configs(tiny_checkpoint):
    """As `vllm serve` and `LLM` build the config (multiprocess executor on the CPU); each
    config logs one line, where vLLM logs (here: stderr)."""
    out = run_python(
        f"MODEL = {tiny_checkpoint!r}\n" + _DECISIONS,
        VLLM_ENABLE_V1_MULTIPROCESSING="1",
        VLLM_LOGGING_STREAM="ext://sys.stderr",
        NO_COLOR="1",
    )
    [line] = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert json.loads(line[len("RESULT ") :]) == {
        "default": [True, "mp"],
        "env off": [False, "mp"],
        "user off": [False, "mp"],
        "ngram": [False, "mp"],
    }
    default, env_off, user_off, ngram = [
        line.split("] ", 1)[1]
        for line in out.stderr.splitlines()
        if "[cpu_async_scheduling.py:" in line
    ]
    assert default == (
        f"Async scheduling on for {V41}: DEEPINFER_ASYNC_SCHEDULING=on, "
        "MultiprocExecutor; the CPU platform's override to off is undone"
    )
    assert env_off == f"Async scheduling off for {V41}: DEEPINFER_ASYNC_SCHEDULING=off"
    for line in (user_off, ngram):  # vLLM decided off before the platform's override
        assert "off" in line and "--no-async-scheduling / async_scheduling=False" in line
    assert "Async scheduling not supported with ngram-based speculative decoding" in out.stderr


# --- the same outputs with async scheduling on and off ---------------------------------------

PROMPT_LENGTHS = (3, 21, 64, 130)  # one batch; with a 64-token budget the long ones chunk
NEW_TOKENS = 12
REGEX = "[a-z]{2,6}-[0-9]{2}"


def outputs_of(llm) -> dict:
    """What the engine ran with (front end, engine core, worker process) and generated:
    greedy tokens with sampled and prompt logprobs, seeded samples, a regex constraint."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    prompts = random_prompts(PROMPT_LENGTHS, seed=31)
    greedy = generate(llm, prompts, new_tokens=NEW_TOKENS)
    seeded = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts],
        SamplingParams(temperature=1.0, seed=5, max_tokens=NEW_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    constrained = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts[:2]],
        SamplingParams(
            temperature=0.0,
            max_tokens=NEW_TOKENS,
            structured_outputs=StructuredOutputsParams(regex=REGEX),
        ),
        use_tqdm=False,
    )
    core = llm.llm_engine.engine_core.engine_core
    return {
        "config": llm.llm_engine.vllm_config.scheduler_config.async_scheduling,
        "scheduler": type(core.scheduler).__name__,
        "executor": type(core.model_executor).__name__,
        # A lambda travels by value to the worker process (this module is not importable there).
        "worker": llm.collective_rpc(lambda worker: worker.model_runner.use_async_scheduling),
        "tokens": [list(o.outputs[0].token_ids) for o in greedy],
        "logprobs": [
            [entry[t].logprob for t, entry in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
            for o in greedy
        ],
        "prompt_logprobs": [
            [entry[t].logprob for t, entry in zip(p[1:], o.prompt_logprobs[1:])]
            for p, o in zip(prompts, greedy)
        ],
        "seeded": [list(o.outputs[0].token_ids) for o in seeded],
        "constrained": [o.outputs[0].text for o in constrained],
    }


@pytest.fixture(scope="module")
def runs(tiny_checkpoint):
    """The same work on two engines, one after the other: the default (async scheduling on)
    and the user's `async_scheduling=False`."""
    results = {}
    for mode, options in (("on", {}), ("off", {"async_scheduling": False})):
        with pytest.MonkeyPatch.context() as env:
            env.delenv("DEEPINFER_ASYNC_SCHEDULING", raising=False)
            llm = make_llm(tiny_checkpoint, distributed_executor_backend="mp", **options)
        try:
            results[mode] = outputs_of(llm)
        finally:
            close_llm(llm)
    return results


@pytest.mark.engine
@pytest.mark.slow  # two engines of their own; every default-run server runs async on
def test_engine_really_ran_with_async_scheduling_on_and_off(runs):
    assert {
        mode: [r["config"], r["scheduler"], r["executor"], r["worker"]] for mode, r in runs.items()
    } == {
        "on": [True, "AsyncScheduler", "MultiprocExecutor", [True]],
        "off": [False, "Scheduler", "MultiprocExecutor", [False]],
    }


@pytest.mark.engine
@pytest.mark.slow  # the same two engines; served outputs match the reference with it on
def test_async_scheduling_changes_no_output(runs):
    on, off = runs["on"], runs["off"]
    for key in ("tokens", "logprobs", "prompt_logprobs", "seeded", "constrained"):
        assert on[key] == off[key], key
    assert [len(t) for t in on["tokens"]] == [NEW_TOKENS] * len(PROMPT_LENGTHS)
    assert all(re.fullmatch(REGEX, text) for text in on["constrained"]), on["constrained"]
