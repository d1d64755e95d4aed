"""The context cache through real servers, started and stopped by PID on one directory:
two servers at once: a prompt computed by one is a hit on the other; 1P1D hand-over; a
block file deleted, truncated, with flipped bytes, unreadable, or a full disk, while
requests run: the answer is recomputed and correct, and the servers keep serving; a
server killed and a new one started on the directory: a prompt the killed one served
is a hit that equals its local prefix hit (tokens and logprobs), and the killed one's
host region is not left in /dev/shm."""

import contextlib
import glob
import os
import subprocess
import threading
import time

import pytest
import requests

from helpers import SERVED_NAME, metric, random_prompts, serve, wait_until_served
from vllm_deepinfer.context_cache import block_file

pytestmark = pytest.mark.server

CACHE_BYTES = "64m"
FLAGS = ("--block-size", "16", "--max-num-batched-tokens", "256")
# How long a decode request waits for announced blocks (a loaded machine's prefill writes
# them within it; the test of blocks that never arrive waits it out).
PD_WAIT_SECONDS = 15


def complete(base: str, prompt: list[int], max_tokens: int = 8, **fields) -> dict:
    """Greedy tokens and logprobs; `fields` added to the body (a `cache_salt` of its own
    makes a cold computation of a prompt the server has seen)."""
    reply = requests.post(
        f"{base}/v1/completions",
        timeout=300,
        json={
            "model": SERVED_NAME,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "logprobs": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            **fields,
        },
    )
    reply.raise_for_status()
    choice = reply.json()["choices"][0]
    return {"tokens": choice["token_ids"], "logprobs": choice["logprobs"]["token_logprobs"]}


def assert_same_answer(answer: dict, expected: dict, tolerance: float = 1e-5) -> None:
    assert answer["tokens"] == expected["tokens"]
    assert answer["logprobs"] == pytest.approx(expected["logprobs"], abs=tolerance)


def block_files(directory) -> set[str]:
    return {str(p) for p in directory.rglob("*.bin")}


def wait_for_blocks(directory, before: set[str], count: int, timeout: float = 120) -> set[str]:
    """The block files a prompt of `count` full blocks added (stores finish after the
    reply)."""
    deadline = time.monotonic() + timeout
    while True:
        added = block_files(directory) - before
        if len(added) >= count or time.monotonic() > deadline:
            assert len(added) >= count, f"{len(added)} of {count} blocks stored"
            return added
        time.sleep(0.2)


def assert_valid_blocks(paths: set[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    for path in sorted(paths):
        layout = bytes.fromhex(path.split("/deepinfer-")[1].split("/")[0])
        while True:
            try:
                size = os.path.getsize(path) - block_file.HEADER_BYTES
                block_file.read_into(path, memoryview(bytearray(size)), layout)
                break
            except OSError:
                assert time.monotonic() < deadline, f"{path} not stored again"
                time.sleep(0.2)


@contextlib.contextmanager
def cache_directory(path):
    """A 64 MiB tmpfs where mounting is allowed (so the full-disk case can fill it), else
    a plain directory."""
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={CACHE_BYTES}", "tmpfs", str(path)],
        capture_output=True,
    )
    try:
        yield path, mounted.returncode == 0
    finally:
        if mounted.returncode == 0:
            subprocess.run(["umount", "-l", str(path)], check=True)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    with cache_directory(tmp_path_factory.mktemp("context-cache") / "dir") as mounted:
        yield mounted


def serve_on(directory, checkpoint: str, log_dir, wait: bool = True):
    """A server of this module on the shared directory (FLAGS, the P/D wait)."""
    return serve(
        checkpoint,
        log_dir,
        "--context-cache-dir",
        str(directory),
        *FLAGS,
        env={"DEEPINFER_PD_KV_WAIT_SECONDS": str(PD_WAIT_SECONDS)},
        wait=wait,
    )


def host_region_names() -> set[str]:
    return set(glob.glob("/dev/shm/vllm_offload_*"))


@pytest.fixture(scope="module")
def regions_before_the_servers() -> set[str]:
    return host_region_names()


@pytest.fixture(scope="module")
def pair(tiny_checkpoint, cache, tmp_path_factory, regions_before_the_servers):
    """Two servers on the directory, started together."""
    directory, _ = cache
    with (
        serve_on(directory, tiny_checkpoint, tmp_path_factory.mktemp("one"), wait=False) as one,
        serve_on(directory, tiny_checkpoint, tmp_path_factory.mktemp("two"), wait=False) as two,
    ):
        wait_until_served(one, two)
        yield one, two


def test_prompt_computed_by_one_server_is_a_hit_on_the_other(pair, cache):
    directory, _ = cache
    one, two = pair
    prompt = random_prompts((300,), seed=261)[0]
    before = block_files(directory)
    complete(one, prompt)
    wait_for_blocks(directory, before, 300 // 16)
    local_hit = complete(one, prompt)
    hits = metric(two, "vllm:external_prefix_cache_hits_total")
    assert_same_answer(complete(two, prompt), local_hit)
    assert metric(two, "vllm:external_prefix_cache_hits_total") - hits == 288


# What vllm-router sends a prefill instance in its vLLM P/D mode (besides max_tokens 1).
ROUTER_PREFILL = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def routed(prefill: str, decode: str, prompt: list[int], max_tokens: int = 8):
    """A request as vllm-router's P/D mode carries it: the prompt to the prefill instance
    for one token, then to the decode instance with the kv_transfer_params the prefill's
    reply carried. Returns the decode's answer and those parameters."""
    body = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "temperature": 0.0,
        "logprobs": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    reply = requests.post(
        f"{prefill}/v1/completions",
        timeout=300,
        json={**body, "max_tokens": 1, "kv_transfer_params": ROUTER_PREFILL},
    )
    reply.raise_for_status()
    handed = reply.json()["kv_transfer_params"]
    reply = requests.post(
        f"{decode}/v1/completions",
        timeout=300,
        json={**body, "max_tokens": max_tokens, "kv_transfer_params": handed},
    )
    reply.raise_for_status()
    choice = reply.json()["choices"][0]
    return {"tokens": choice["token_ids"], "logprobs": choice["logprobs"]["token_logprobs"]}, handed


def test_prefill_decode_handoff_equals_a_local_hit(pair, cache):
    """1P1D over the shared directory: the decode instance, asked at once (before the
    prefill's blocks are all on disk), waits for the announced blocks, loads the prompt's
    global KV, replays the last 140 tokens itself, and answers as a local prefix hit
    with bounded replay does."""
    prefill, decode = pair
    prompt = random_prompts((410,), seed=264)[0]
    before = {
        name: metric(decode, name)
        for name in (
            "vllm:external_prefix_cache_hits_total",
            "deepinfer:prefix_replayed_tokens_total",
            "deepinfer:pd_kv_waits_total",
        )
    }
    answer, handed = routed(prefill, decode, prompt)
    assert handed["deepinfer_global_kv"]["tokens"] == 410
    assert (
        metric(decode, "vllm:external_prefix_cache_hits_total")
        - before["vllm:external_prefix_cache_hits_total"]
        == 400
    )  # every whole block
    assert (
        metric(decode, "deepinfer:prefix_replayed_tokens_total")
        - before["deepinfer:prefix_replayed_tokens_total"]
        == 140
    )
    assert metric(decode, "deepinfer:pd_kv_waits_total", outcome="timed_out") == 0
    assert_same_answer(answer, complete(prefill, prompt))  # a local hit on the prefill


def test_announced_blocks_that_never_arrive_are_recomputed(pair, cache):
    """A decode request whose announced blocks never reach the directory waits
    DEEPINFER_PD_KV_WAIT_SECONDS, says so in the log and the counter, recomputes, and
    answers as a cold computation does."""
    prefill, decode = pair
    prompt = random_prompts((120,), seed=265)[0]
    directory, _ = cache
    [layout] = [
        d.name.removeprefix("deepinfer-")
        for d in directory.iterdir()
        if d.name.startswith("deepinfer-")
    ]  # the servers' one layout
    timed_out = metric(decode, "deepinfer:pd_kv_waits_total", outcome="timed_out")
    body = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "temperature": 0.0,
        "logprobs": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "max_tokens": 8,
        "kv_transfer_params": {"deepinfer_global_kv": {"layout": layout, "tokens": 120}},
    }
    started = time.monotonic()
    reply = requests.post(f"{decode}/v1/completions", timeout=300, json=body)
    reply.raise_for_status()
    assert time.monotonic() - started >= PD_WAIT_SECONDS
    choice = reply.json()["choices"][0]
    answer = {"tokens": choice["token_ids"], "logprobs": choice["logprobs"]["token_logprobs"]}
    assert metric(decode, "deepinfer:pd_kv_waits_total", outcome="timed_out") == timed_out + 1
    assert "was not on disk after" in decode.stdout.read_text() + decode.stderr.read_text()
    assert_same_answer(answer, complete(prefill, prompt), tolerance=2e-3)


def damage(paths: set[str], fault: str) -> None:
    for path in paths:
        if fault == "delete":
            os.remove(path)
        elif fault == "truncate":
            os.truncate(path, os.path.getsize(path) // 2)
        elif fault == "flip_bytes":
            with open(path, "r+b") as f:
                f.seek(-100, os.SEEK_END)
                byte = f.read(1)
                f.seek(-100, os.SEEK_END)
                f.write(bytes([byte[0] ^ 0xFF]))
        elif fault == "permissions":
            os.chmod(path, 0)


@contextlib.contextmanager
def requests_running(base: str):
    """A request decoding on `base` meanwhile; it must finish normally."""
    done = {}
    thread = threading.Thread(
        target=lambda: done.update(
            answer=complete(base, random_prompts((100,), seed=262)[0], max_tokens=48)
        )
    )
    thread.start()
    try:
        yield
    finally:
        thread.join(timeout=300)
    assert len(done["answer"]["tokens"]) == 48


@pytest.mark.parametrize("fault", ["delete", "truncate", "flip_bytes", "permissions"])
def test_damaged_blocks_are_recomputed(pair, cache, fault):
    """The first server computes a prompt (its answer is the cold answer); its files are
    damaged; the second server, which never saw the prompt, finds them, fails to load
    them, recomputes, and answers exactly as a cold computation does."""
    if fault == "permissions" and os.geteuid() == 0:
        pytest.skip(
            "root reads files whatever their permissions (the tier's handling of "
            "an unreadable file is covered in test_disk_tier.py)"
        )
    directory, _ = cache
    one, two = pair
    prompt = random_prompts((200,), seed=263 + len(fault))[0]
    before = block_files(directory)
    cold = complete(one, prompt)
    files = wait_for_blocks(directory, before, 200 // 16)
    failures = metric(two, "deepinfer:context_cache_load_failures_total")
    with requests_running(two):
        damage(files, fault)
        # the batch holds the other request: compared within the engine's tolerance
        assert_same_answer(complete(two, prompt), cold, tolerance=2e-3)
    if fault != "delete":  # a deleted file is a lookup miss, never a failed load
        assert metric(two, "deepinfer:context_cache_load_failures_total") > failures
    assert_valid_blocks(files)  # removed, and stored again from the recomputed KV
    assert_same_answer(complete(two, prompt), complete(one, prompt))  # both still serve


def test_full_disk_recomputes_and_keeps_serving(pair, cache):
    """With the disk full, stores fail (counted) and the janitor makes room by removing
    the least recently used blocks; answers are computed as without a cache (the other
    server, with nothing of this prompt on disk, agrees) and blocks are stored again."""
    directory, mounted = cache
    if not mounted:
        pytest.skip("filling the disk needs a tmpfs mount, refused here")
    one, two = pair
    filler = directory / "filler"
    prompt = random_prompts((200,), seed=270)[0]
    before = block_files(directory)
    try:
        with open(filler, "wb") as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 2**20)
                f.flush()
        failures = metric(one, "deepinfer:context_cache_store_failures_total")
        with requests_running(one):
            answer = complete(one, prompt)
        deadline = time.monotonic() + 60
        while metric(one, "deepinfer:context_cache_store_failures_total") == failures:
            assert time.monotonic() < deadline, "no store failed on a full disk"
            time.sleep(0.5)
    finally:
        filler.unlink(missing_ok=True)
    deadline = time.monotonic() + 60
    while not metric(one, "deepinfer:context_cache_evicted_files_total", reason="space"):
        assert time.monotonic() < deadline, "the janitor made no room"
        time.sleep(0.5)
    for path in block_files(directory) - before:  # what room let through: a cold start
        os.remove(path)
    cleared = block_files(directory)
    assert_same_answer(answer, complete(two, prompt), tolerance=2e-3)
    wait_for_blocks(directory, cleared, 200 // 16)  # stored again


def test_unreachable_store_recomputes_and_keeps_serving(pair, cache):
    """The shared directory unreachable (a read-only file system mounted over it: lookups
    find nothing, stores fail): a handed-over request waits for its announced blocks,
    recomputes, and answers as a cold computation does; once the directory is back,
    blocks are stored again."""
    directory, mounted = cache
    if not mounted:
        pytest.skip("covering the directory needs a mount, refused here")
    prefill, decode = pair
    prompt = random_prompts((260,), seed=271)[0]
    failures = metric(prefill, "deepinfer:context_cache_store_failures_total")
    timed_out = metric(decode, "deepinfer:pd_kv_waits_total", outcome="timed_out")
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(directory)], check=True
    )
    try:
        answer, _ = routed(prefill, decode, prompt)
        assert metric(decode, "deepinfer:pd_kv_waits_total", outcome="timed_out") == timed_out + 1
        deadline = time.monotonic() + 60
        while metric(prefill, "deepinfer:context_cache_store_failures_total") == failures:
            assert time.monotonic() < deadline, "no store failed on an unreachable directory"
            time.sleep(0.5)
    finally:
        subprocess.run(["umount", str(directory)], check=True)
    assert_same_answer(answer, complete(prefill, prompt, cache_salt="cold"), tolerance=2e-3)
    other = random_prompts((100,), seed=272)[0]
    before = block_files(directory)
    complete(prefill, other)
    wait_for_blocks(directory, before, 100 // 16)


def stream_tokens(base: str, prompt: list[int], max_tokens: int, outcome: dict) -> None:
    """A streamed completion; `outcome` gets the tokens seen and how the stream ended."""
    outcome["chunks"] = 0
    try:
        with requests.post(
            f"{base}/v1/completions",
            stream=True,
            timeout=120,
            json={
                "model": SERVED_NAME,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
            },
        ) as reply:
            for line in reply.iter_lines():
                outcome["chunks"] += line.startswith(b"data: {")
        outcome["ended"] = "complete"
    except requests.RequestException as exc:
        outcome["ended"] = type(exc).__name__


def kill_mid_request(server, prompt: list[int], max_tokens: int, after_chunks: int) -> dict:
    """Streams a request and kills the server's whole process group once `after_chunks`
    chunks came (0: while the prompt is computed); the client's outcome."""
    outcome: dict = {}
    client = threading.Thread(target=stream_tokens, args=(server, prompt, max_tokens, outcome))
    client.start()
    deadline = time.monotonic() + 120
    while outcome.get("chunks", 0) < after_chunks or "chunks" not in outcome:
        assert time.monotonic() < deadline and client.is_alive(), outcome
        time.sleep(0.05)
    time.sleep(0.2 if after_chunks == 0 else 0)
    os.killpg(server.process.pid, 9)
    server.process.wait(timeout=60)
    client.join(timeout=150)
    assert not client.is_alive(), "the client hangs on a killed server"
    return outcome


# A prompt the decode instance serves before it is killed; a new instance finds it on disk.
RESTART_PROMPT = random_prompts((420,), seed=260)[0]


@pytest.fixture(scope="module")
def restart(pair, cache, tiny_checkpoint, tmp_path_factory):
    """The decode instance serves RESTART_PROMPT twice (cold, then a local prefix hit),
    then its process group is killed while it streams another request, and a new
    decode instance starts on the same directory: (the local hit, the stream's outcome,
    the new instance). The tests using it come last in the file: the pair is over."""
    _, decode = pair
    directory, _ = cache
    before = block_files(directory)
    complete(decode, RESTART_PROMPT)
    local_hit = complete(decode, RESTART_PROMPT)
    wait_for_blocks(directory, before, len(RESTART_PROMPT) // 16)
    broken = kill_mid_request(decode, random_prompts((50,), seed=273)[0], 400, after_chunks=2)
    with serve_on(directory, tiny_checkpoint, tmp_path_factory.mktemp("restarted")) as restarted:
        yield local_hit, broken, restarted


def test_decode_killed_mid_stream_breaks_the_stream(restart):
    """The client's stream breaks (no hang)."""
    _, broken, _ = restart
    assert broken["ended"] != "complete" or broken["chunks"] < 400, broken


def test_killed_server_leaves_no_host_region(restart, regions_before_the_servers):
    """The running servers' host regions have no name in /dev/shm, so the killed one's
    pages went with its processes."""
    assert host_region_names() <= regions_before_the_servers


def test_hit_after_restart_equals_a_local_hit(restart):
    local_hit, _, restarted = restart
    assert metric(restarted, "vllm:external_prefix_cache_hits_total") == 0
    assert_same_answer(complete(restarted, RESTART_PROMPT), local_hit)
    assert metric(restarted, "vllm:external_prefix_cache_hits_total") == 416
    assert metric(restarted, "deepinfer:context_cache_loaded_blocks_total") == 26


def test_restarted_decode_takes_hand_overs_and_prefill_killed_mid_request(pair, restart):
    """The new decode instance takes handed-over requests and answers as a local hit on
    the prefill does. Prefill killed while it computes a prompt: its client gets an
    error at once, and the decode instance keeps serving. (Last in the file: it ends the
    pair.)"""
    prefill, _ = pair
    _, _, restarted = restart
    prompt = random_prompts((330,), seed=274)[0]
    answer, _ = routed(prefill, restarted, prompt)
    assert_same_answer(answer, complete(prefill, prompt))
    cut = kill_mid_request(prefill, random_prompts((1800,), seed=275)[0], 200, after_chunks=0)
    assert cut["ended"] != "complete", cut
    other = random_prompts((60,), seed=276)[0]
    assert len(complete(restarted, other)["tokens"]) == 8
