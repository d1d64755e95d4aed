"""V4.1 leaves one process through vLLM's own parallelism, tested on real servers:
`--tensor-parallel-size 2`, and DeepInfer's layout `--data-parallel-size 2
--enable-expert-parallel` with EPLB (redundant experts, a rearrangement every few steps).
Greedy tokens equal the single-process model (the dense reference forward) and logprobs
stay within the fidelity tolerance; with batch invariance on, a request gives the same
bits before and after rearrangements moved its experts. Each server is stopped by its
PID and none of its processes (engine cores, workers) outlives it."""
import json
import re
import time

import pytest
import requests

from helpers import LOGPROB_TOLERANCE, SERVED_NAME, group_alive, serve
from vllm_deepinfer.model.reference import ReferenceV41

pytestmark = pytest.mark.server

PROMPTS = [list(range(100 + 7 * i, 130 + 11 * i)) for i in range(4)]
NEW_TOKENS = 12
# Two local CPU workers: one core each (vLLM's automatic binding wants a NUMA node each).
TWO_WORKERS = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
EPLB_CONFIG = {"window_size": 4, "step_interval": 8, "num_redundant_experts": 2,
               "log_balancedness": True, "policy": "deepinfer", "use_async": False}


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    return ReferenceV41(tiny_checkpoint)


def _complete(base: str, prompt: list[int], new_tokens: int = NEW_TOKENS):
    response = requests.post(f"{base}/v1/completions", timeout=300, json={
        "model": SERVED_NAME, "prompt": prompt, "max_tokens": new_tokens,
        "temperature": 0, "logprobs": 1, "return_token_ids": True, "ignore_eos": True})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def _assert_single_process_output(reference, prompt, tokens, logprobs):
    expected = reference.logits(prompt + tokens[:-1]).log_softmax(-1)[len(prompt) - 1:]
    assert expected.argmax(-1).tolist() == tokens
    for step, token in enumerate(tokens):
        assert logprobs[step] == pytest.approx(expected[step, token].item(),
                                               abs=LOGPROB_TOLERANCE)


def _stopped_by_pid(base) -> None:
    """After the serve block (SIGTERM to the server's PID): no process of it is left."""
    deadline = time.monotonic() + 30
    while group_alive(base.process.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not group_alive(base.process.pid), "a process of the server outlived it"


def test_tensor_parallel_2_equals_one_process(tiny_checkpoint, reference, tmp_path):
    with serve(tiny_checkpoint, tmp_path, "--tensor-parallel-size", "2",
               env=TWO_WORKERS) as base:
        outputs = [_complete(base, prompt) for prompt in PROMPTS]
        log = base.stdout.read_text() + base.stderr.read_text()
    _stopped_by_pid(base)
    assert "tensor_parallel_size=2" in log
    for prompt, (tokens, logprobs) in zip(PROMPTS, outputs):
        _assert_single_process_output(reference, prompt, tokens, logprobs)


def test_data_and_expert_parallel_with_eplb(tiny_checkpoint, reference, tmp_path):
    with serve(tiny_checkpoint, tmp_path, "--data-parallel-size", "2", "--api-server-count", "1",
               "--enable-expert-parallel", "--enable-eplb",
               "--eplb-config", json.dumps(EPLB_CONFIG),
               env={**TWO_WORKERS, "DEEPINFER_BATCH_INVARIANT": "1"}) as base:
        def rearrangements() -> int:
            log = base.stdout.read_text() + base.stderr.read_text()
            return len(re.findall(r"Rearranged experts", log))

        first = _complete(base, PROMPTS[0], new_tokens=24)
        outputs = [_complete(base, prompt) for prompt in PROMPTS[1:]]
        before = rearrangements()
        again = _complete(base, PROMPTS[0], new_tokens=24)
        after = rearrangements()
        metrics = requests.get(f"{base}/metrics", timeout=10).text
        log = base.stdout.read_text() + base.stderr.read_text()
    _stopped_by_pid(base)
    assert "EP rank 1" in log and "Using allgather_reducescatter all2all manager" in log
    assert before >= 2 and after > before, (before, after)  # experts moved in between
    assert re.search(r"EPLB step: \d+ .*balancedness=", log)
    # moe_lb beside vLLM's balancedness, and on /metrics per layer and overall.
    logged = [float(v) for v in re.findall(r"EPLB step \d+: moe_lb=([\d.]+)", log)]
    assert logged and all(value >= 1.0 for value in logged)
    overall = re.findall(r'^deepinfer:moe_lb_overall\{[^}]*\} ([\d.]+)$', metrics, re.M)
    layers = re.findall(r'^deepinfer:moe_lb\{[^}]*layer="(\d+)"[^}]*\} ([\d.]+)$', metrics,
                        re.M)
    assert overall and float(overall[0]) >= 1.0
    assert {int(layer) for layer, _ in layers} == set(range(10))
    assert again == first  # bit for bit, across rearrangements
    for prompt, (tokens, logprobs) in zip(PROMPTS, [first, *outputs]):
        _assert_single_process_output(reference, prompt, tokens, logprobs)
