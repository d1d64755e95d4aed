"""V4.1 leaves one process through vLLM's own parallelism, tested on real servers of the
release form (MXFP8 linears, MXFP4 experts kept as stored):
`--tensor-parallel-size 2`, and DeepInfer's layout `--data-parallel-size 2
--enable-expert-parallel` with EPLB (redundant experts, a rearrangement every few steps).
Greedy tokens equal the single-process model (the dense reference forward) and logprobs
stay within the fidelity tolerance, also for prompts longer than the replay keep on DP=2
(decoder-side replay leaves a rank fewer rows at the experts than it announced, or
none); every sampling parameter is served on both layouts;
with batch invariance on, a request gives the same
bits before and after rearrangements moved its experts. Each server is stopped by a
SIGTERM to its process group, cleanly, and none of its processes outlives it."""

import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from fixtures.reference import ReferenceV41
from helpers import (
    SERVED_NAME,
    TWO_WORKERS,
    assert_single_process_output,
    data_and_expert_parallel_args,
    group_alive,
    serve,
    served_greedy,
)

pytestmark = pytest.mark.server

PROMPTS = [list(range(100 + 7 * i, 130 + 11 * i)) for i in range(4)]
NEW_TOKENS = 12
# Longer than the replay keep (140): after the cut layer decoder-side replay computes each
# request's last 140 prompt rows only, fewer than its rank announced to the EP group.
LONG_PROMPTS = [list(range(200, 500)), list(range(600, 817)), list(range(900, 1161))]
REGEX = r"[a-z]{2,4}( [a-z]{2,4}){1,2}"


@pytest.fixture(scope="module")
def reference(quantized_checkpoint):
    return ReferenceV41(quantized_checkpoint)


def _serves_every_sampling_parameter(base: str, prompt: list[int], greedy: list[int]) -> None:
    """Each sampling parameter over HTTP on the layout: top-k 1 at a temperature gives the
    greedy tokens, a seeded request repeats itself, `n` gives its choices, top-k / top-p /
    min-p / penalties / logit bias / stop strings are served, a regex is obeyed, and the
    server answers afterwards."""

    def complete(**options):
        response = requests.post(
            f"{base}/v1/completions",
            timeout=300,
            json={
                "model": SERVED_NAME,
                "prompt": prompt,
                "max_tokens": len(greedy),
                "return_token_ids": True,
                "ignore_eos": True,
                **options,
            },
        )
        assert response.status_code == 200, (options, response.text)
        return [choice["token_ids"] for choice in response.json()["choices"]]

    assert complete(temperature=0.8, top_k=1, seed=1) == [greedy]
    seeded = dict(temperature=1.0, top_k=20, top_p=0.9, seed=7)
    assert complete(**seeded) == complete(**seeded)
    assert len(complete(temperature=1.0, n=3, seed=3)) == 3
    for options in (
        dict(temperature=0.9, min_p=0.2),
        dict(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3),
        dict(temperature=0.7, logprobs=5, stop=["e"], ignore_eos=False),
    ):
        complete(**options)
    assert complete(temperature=0.0, logit_bias={str(greedy[0]): -100.0})[0][0] != greedy[0]
    # A text prompt: decoded after a random token prompt, the text can start with its bytes.
    response = requests.post(
        f"{base}/v1/completions",
        timeout=300,
        json={
            "model": SERVED_NAME,
            "prompt": "Name two colours:",
            "max_tokens": 12,
            "temperature": 0.8,
            "structured_outputs": {"regex": REGEX},
        },
    )
    assert response.status_code == 200, response.text
    assert re.fullmatch(REGEX, response.json()["choices"][0]["text"]), response.text
    assert complete(temperature=0.0) == [greedy]  # alive, and right


def _stopped_cleanly(base) -> None:
    """After the serve block (SIGTERM to the server's process group, as systemd or
    `kill -- -PGID` send it): no process of it is left, and none of them died on the way
    (a worker ended mid-step kills its engine core with a fatal error)."""
    deadline = time.monotonic() + 30
    while group_alive(base.process.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not group_alive(base.process.pid), "a process of the server outlived it"
    log = base.stdout.read_text() + base.stderr.read_text()
    # The engine core finishes its teardown (the process manager's SIGTERM that follows
    # the group's once killed it midway, leaving shared memory to the resource tracker).
    unclean = [
        line
        for line in log.splitlines()
        if any(
            sign in line
            for sign in (
                "died unexpectedly",
                "fatal error",
                "force killing",
                "sending SIGKILL",
                "leaked shared_memory",
                "leaked semaphore",
            )
        )
    ]
    # On failure, the shutdown's course: each process's steps with their times.
    course = "\n".join(
        line[:240]
        for line in log.splitlines()
        if "[shutdown]" in line or "Traceback" in line or "Error" in line
    )
    assert unclean == [], course


@pytest.mark.slow  # TP=2 on the release form serves in the default run (test_faults)
def test_tensor_parallel_2_equals_one_process(quantized_checkpoint, reference, tmp_path):
    """The release form (MXFP8 linears, MXFP4 experts kept as stored), each rank holding
    its share of every weight and scale."""
    with serve(
        quantized_checkpoint, tmp_path, "--tensor-parallel-size", "2", env=TWO_WORKERS
    ) as base:
        outputs = [served_greedy(base, prompt, NEW_TOKENS) for prompt in PROMPTS]
        _serves_every_sampling_parameter(base, PROMPTS[0], outputs[0][0])
        log = base.stdout.read_text() + base.stderr.read_text()
    _stopped_cleanly(base)
    assert "tensor_parallel_size=2" in log
    for prompt, (tokens, logprobs) in zip(PROMPTS, outputs):
        assert_single_process_output(reference, prompt, tokens, logprobs)


def test_data_and_expert_parallel_with_eplb(quantized_checkpoint, reference, tmp_path):
    """The release form: EPLB moves MXFP4 experts between ranks as stored, scales with
    them."""
    with serve(
        quantized_checkpoint,
        tmp_path,
        *data_and_expert_parallel_args(),
        # Long prompts in chunks: a chunk wholly before a request's kept rows
        # leaves its rank no rows after the cut layer.
        "--max-num-batched-tokens",
        "128",
        env={**TWO_WORKERS, "DEEPINFER_BATCH_INVARIANT": "1"},
    ) as base:

        def rearrangements() -> int:
            log = base.stdout.read_text() + base.stderr.read_text()
            return len(re.findall(r"Rearranged experts", log))

        first = served_greedy(base, PROMPTS[0], 24)
        outputs = [served_greedy(base, prompt, NEW_TOKENS) for prompt in PROMPTS[1:]]
        _serves_every_sampling_parameter(base, PROMPTS[1], outputs[0][0])
        # One long prompt alone (the other rank runs a dummy batch), then two at once.
        long = [served_greedy(base, LONG_PROMPTS[0], 8)]
        with ThreadPoolExecutor(2) as pool:
            long += pool.map(lambda prompt: served_greedy(base, prompt, 8), LONG_PROMPTS[1:])
        before = rearrangements()
        again = served_greedy(base, PROMPTS[0], 24)
        after = rearrangements()
        metrics = requests.get(f"{base}/metrics", timeout=10).text
        log = base.stdout.read_text() + base.stderr.read_text()
    _stopped_cleanly(base)
    assert "EP rank 1" in log and "Using allgather_reducescatter all2all manager" in log
    assert before >= 2 and after > before, (before, after)  # experts moved in between
    assert re.search(r"EPLB step: \d+ .*balancedness=", log)
    # moe_lb beside vLLM's balancedness, and on /metrics per layer and overall.
    logged = [float(v) for v in re.findall(r"EPLB step \d+: moe_lb=([\d.]+)", log)]
    assert logged and all(value >= 1.0 for value in logged)
    overall = re.findall(r"^deepinfer:moe_lb_overall\{[^}]*\} ([\d.]+)$", metrics, re.M)
    layers = re.findall(r'^deepinfer:moe_lb\{[^}]*layer="(\d+)"[^}]*\} ([\d.]+)$', metrics, re.M)
    assert overall and float(overall[0]) >= 1.0
    assert {int(layer) for layer, _ in layers} == set(range(10))
    assert again == first  # bit for bit, across rearrangements
    for prompt, (tokens, logprobs) in zip(PROMPTS + LONG_PROMPTS, [first, *outputs, *long]):
        assert_single_process_output(reference, prompt, tokens, logprobs)
