"""V4.1 across Ray, the way a multi-node deployment runs it: a local Ray cluster
(`ray start --head --node-ip-address 127.0.0.1`, which Ray advertises under the machine's
own address; started by this module and stopped by its PID) serves
`--distributed-executor-backend ray --tensor-parallel-size 2` and Ray's data-parallel
backend with expert parallelism (`--data-parallel-size 2 --data-parallel-backend ray
--enable-expert-parallel`). Greedy tokens equal the single-process model (the dense
reference forward) and logprobs stay within the fidelity tolerance; no process of the
cluster outlives it.

vLLM places its Ray workers by the platform's `ray_device_key`, a Ray resource each
worker holds one of; vLLM 0.32's CPU platform has none ("does not support ray"): the
plugin's `cpu_ray` patch gives it `deepinfer_cpu`, which the cluster advertises on its
node (`ray start --resources`). Where the platform has no key the tests skip, naming it."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fixtures.reference import ReferenceV41
from helpers import (
    TWO_WORKERS,
    _free_port,
    assert_single_process_output,
    group_alive,
    serve,
    served_greedy,
)

pytestmark = pytest.mark.server
pytest.importorskip("ray", reason="the Ray backends need Ray: pip install -e '.[ray]'")

PROMPTS = [list(range(100, 130)), list(range(300, 341))]
NEW_TOKENS = 6
WORKER_SLOTS = 4  # TP=2: two workers; DP=2: two engine cores, one worker each
CLUSTER_STARTUP_TIMEOUT_S = 120
CLUSTER_READY_LINE = "This command will now block forever"


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    return ReferenceV41(tiny_checkpoint)


@pytest.fixture(scope="module")
def ray_device_key() -> str:
    """The Ray resource vLLM's workers hold on this platform, as the plugin leaves it."""
    from vllm.platforms import current_platform

    from vllm_deepinfer.plugins import register

    register()
    if not current_platform.ray_device_key:
        pytest.skip(
            f"vLLM's {current_platform.device_name} platform has no Ray device key "
            "(`ray_device_key`): its Ray executors refuse to start"
        )
    return current_platform.ray_device_key


@pytest.fixture(scope="module")
def ray_cluster(ray_device_key, tmp_path_factory):
    """A one-node Ray cluster on 127.0.0.1, as `ray start --head --block` keeps it: in a
    process group of its own, whose leader stops every process it started on SIGTERM
    (a SIGTERM to the whole group leaves the GCS server running). Yields the address
    for RAY_ADDRESS."""
    temp_dir = tmp_path_factory.mktemp("ray")  # short: Ray's socket paths are bounded
    log = temp_dir / "ray-start.log"
    port = _free_port()
    command = [
        str(Path(sys.executable).parent / "ray"),
        "start",
        "--head",
        "--block",
        "--node-ip-address",
        "127.0.0.1",
        "--port",
        str(port),
        "--num-cpus",
        str(WORKER_SLOTS),
        "--resources",
        json.dumps({ray_device_key: WORKER_SLOTS}),
        "--disable-usage-stats",
        "--include-dashboard=false",
        "--temp-dir",
        str(temp_dir),
    ]
    # Ray's memory monitor kills workers by the node's memory in use, other tenants'
    # included: off, as on any shared test machine.
    env = {**os.environ, "RAY_memory_monitor_refresh_ms": "0"}
    with open(log, "w") as out:
        head = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        deadline = time.monotonic() + CLUSTER_STARTUP_TIMEOUT_S
        while CLUSTER_READY_LINE not in log.read_text():
            if head.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the Ray head did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield f"127.0.0.1:{port}"
    finally:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
        deadline = time.monotonic() + 30
        while group_alive(head.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        lingering = group_alive(head.pid)
        if lingering:
            os.killpg(head.pid, signal.SIGKILL)
    assert not lingering, "a process of the Ray cluster outlived its head"


def _serve_on_ray(
    tiny_checkpoint,
    tmp_path,
    ray_cluster,
    reference,
    *layout: str,
    env: dict[str, str] | None = None,
) -> str:
    """Serves `layout` on the cluster (`env` added to the server's environment), checks
    each prompt's greedy tokens and logprobs against the reference, and returns the
    server's log."""
    # RAY_DEDUP_LOGS=0: Ray folds its actors' lines that differ in numbers only (one
    # per rank) into one.
    with serve(
        tiny_checkpoint,
        tmp_path,
        *layout,
        env={**TWO_WORKERS, "RAY_ADDRESS": ray_cluster, "RAY_DEDUP_LOGS": "0", **(env or {})},
    ) as base:
        outputs = [served_greedy(base, prompt, NEW_TOKENS) for prompt in PROMPTS]
        log = base.stdout.read_text() + base.stderr.read_text()
    for prompt, (tokens, logprobs) in zip(PROMPTS, outputs):
        assert_single_process_output(reference, prompt, tokens, logprobs)
    return log


@pytest.mark.slow  # TP=2 and DP + EP run on vLLM's own executor in the default run
def test_tensor_parallel_2_on_ray(tiny_checkpoint, reference, ray_cluster, tmp_path):
    log = _serve_on_ray(
        tiny_checkpoint,
        tmp_path,
        ray_cluster,
        reference,
        "--distributed-executor-backend",
        "ray",
        "--tensor-parallel-size",
        "2",
    )
    assert "RayWorkerProc" in log and "tensor_parallel_size=2" in log


@pytest.mark.slow  # see above; tests/patches/test_cpu_ray.py checks the patch itself
def test_data_and_expert_parallel_on_ray(tiny_checkpoint, reference, ray_cluster, tmp_path):
    """The engine cores are Ray actors too, started with the variables vLLM carries
    over: a DEEPINFER_* setting (a replay keep longer than the prompts, which leaves
    their outputs alone) reaches the model in both."""
    log = _serve_on_ray(
        tiny_checkpoint,
        tmp_path,
        ray_cluster,
        reference,
        "--data-parallel-size",
        "2",
        "--data-parallel-backend",
        "ray",
        "--enable-expert-parallel",
        "--api-server-count",
        "1",
        env={"DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": "150"},
    )
    assert "DPMoEEngineCoreActor" in log and "EP rank 1" in log
    assert log.count("Bounded replay of 150 tokens") == 2, "a DP rank lost DEEPINFER_*"
