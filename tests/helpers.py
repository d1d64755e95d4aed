"""What the tests share: engine construction, prompts, greedy generation and the
comparison against the dense reference forward. Fixtures live in conftest.py."""

from __future__ import annotations

import base64
import contextlib
import errno
import gc
import importlib
import io
import itertools
import json
import logging
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import types
import zlib
from pathlib import Path

import pytest
import torch

from vllm_deepinfer.serving.health import wait_until_healthy

SERVED_NAME = "tiny-v41"
NO_THINKING = {"thinking": {"type": "disabled"}}  # DeepSeek API extra field: thinking off
LOGPROB_TOLERANCE = 2e-3  # fp32 paged engine vs fp64 dense reference


def without_model_runner_v1() -> str | None:
    """Why a test of a Model Runner V1 feature is skipped here (the installed vLLM has no
    such runner: 0.34 removed it), or None where it has one. conftest.py skips the tests
    marked `model_runner_v1` with it; a module that imports the plugin's V1 parts at the
    top skips itself with it (`pytest.skip(..., allow_module_level=True)`)."""
    from vllm_deepinfer import vllm_support

    if vllm_support.has_model_runner_v1():
        return None
    return (
        f"needs vLLM's Model Runner V1, which the installed vLLM "
        f"{vllm_support.installed_vllm()} does not have"
    )


def upstream(module: str, name: str):
    """An upstream (vLLM or transformers) symbol used as an oracle; skips, naming it, only
    where the installed version lacks it."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        pytest.skip(f"{module}.{name} is not available ({e}); oracle missing")


@contextlib.contextmanager
def logged_records(logger: logging.Logger):
    """Every record `logger` emits meanwhile, at every level. vLLM's `vllm` tree does not
    propagate (caplog's root handler sees nothing) and is only set to INFO once a vLLM
    process configures its logging, so the handler and the level go on the logger itself."""
    records = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler, level = Collect(level=logging.DEBUG), logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    """`python -c code` in a fresh process (with `env` added); fails the test on a
    non-zero exit, showing its stderr."""
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result


AUTOGROUPS = Path("/proc/sys/kernel/sched_autogroup_enabled")


class EarlyRun:
    """A long subprocess a test waits on (`make demo`'s first compile, the quick pair's
    training); its output goes to files. `beside_tests`: started at the end of collection
    (conftest.py), it runs beside the tests before it at the lowest CPU priority, on the
    core time they leave idle (a server start keeps one core busy, a server test often
    one), without slowing them: at normal priority its threads and theirs took turns on
    the two cores (a 5 s training test took 76 s). From the stdout line
    `normal_priority_from` on, and once a test waits for it, it runs at normal priority
    again (the demo's teardown has time limits).

    Where the kernel groups tasks by session (Linux's autogroups, on by default), a
    process's niceness counts only against its own session's: the run gets a session of
    its own, whose niceness is set (any user may set 0 to 19 there). Elsewhere its
    processes are niced, and only root may lower that again: without root, a run that
    must return to normal priority keeps it throughout."""

    def __init__(
        self,
        command: list[str],
        cwd: str,
        env: dict[str, str],
        beside_tests: bool = False,
        normal_priority_from: str | None = None,
    ):
        directory = Path(tempfile.mkdtemp(prefix="early-run-"))
        self.stdout, self.stderr = directory / "stdout", directory / "stderr"
        self.by_session = beside_tests and AUTOGROUPS.exists() and AUTOGROUPS.read_text() == "1\n"
        niced = (
            beside_tests
            and not self.by_session
            and (normal_priority_from is None or os.geteuid() == 0)
        )
        with open(self.stdout, "w") as out, open(self.stderr, "w") as err:
            self.process = subprocess.Popen(
                command,
                cwd=cwd,
                env=env,
                stdout=out,
                stderr=err,
                start_new_session=True,  # its processes are one group: killed together
                preexec_fn=(lambda: os.nice(19)) if niced else None,
            )
        if self.by_session:
            self._session_niceness(19)
        if (self.by_session or niced) and normal_priority_from is not None:
            threading.Thread(
                target=self._normal_priority_from, args=(normal_priority_from,), daemon=True
            ).start()

    def _session_niceness(self, value: int) -> None:
        for _ in range(20):  # the kernel takes one change per 100 ms from a user
            try:
                Path(f"/proc/{self.process.pid}/autogroup").write_text(str(value))
                return
            except BlockingIOError:
                time.sleep(0.1)
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                return

    def _normal_priority_from(self, line: str) -> None:
        while self.process.poll() is None:
            if line in self.stdout.read_text():
                self._normal_priority()
                return
            time.sleep(0.5)

    def _normal_priority(self) -> None:
        if self.by_session:
            self._session_niceness(0)
        else:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.setpriority(os.PRIO_PGRP, self.process.pid, 0)

    def result(self, timeout: float) -> subprocess.CompletedProcess:
        """Its exit status and output, once it ends (killed past `timeout`)."""
        self._normal_priority()
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        return subprocess.CompletedProcess(
            self.process.args,
            self.process.returncode,
            self.stdout.read_text(),
            self.stderr.read_text(),
        )

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


EARLY_RUNS: dict[str, EarlyRun] = {}
"""The runs conftest.py started for the tests selected, by name, until a test takes one."""
ROOT = str(Path(__file__).resolve().parents[1])


def demo_run(beside_tests: bool = False) -> EarlyRun:
    """`make demo`'s script as a user first runs it (its default checkpoint, compiled as V4.1
    runs by default), with this environment but for the tests' in-process engines; its
    worker bound to the last core, beside the tests that run meanwhile (vLLM binds a lone
    worker to the first core, as it does the servers' of those tests). At normal priority
    once it reports its speed: its teardown follows."""
    env = {k: v for k, v in session_environment().items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(max(os.sched_getaffinity(0))))
    env["PYTHONUNBUFFERED"] = "1"  # its lines reach the file as printed: the speed line too
    return EarlyRun(
        [sys.executable, os.path.join("examples", "offline_inference.py")],
        ROOT,
        env,
        beside_tests=beside_tests,
        normal_priority_from=" tokens/s",
    )


def training_run(recipe: str, out: str, beside_tests: bool = False) -> EarlyRun:
    """`python -m fixtures.trained` training `recipe`'s pair into `out`, as `make
    trained-pair` trains: in a fresh process, since the state a test process has gathered
    changes the training's rounding (an in-process quick run missed its calibration
    bound, 0.265 against 0.25; the same recipe in a fresh process gave 0.126)."""
    command = [sys.executable, "-m", "fixtures.trained", "--recipe", recipe, "--out", out]
    return EarlyRun(command, ROOT, session_environment(), beside_tests=beside_tests)


def make_llm(model: str, **overrides):
    from vllm import LLM

    options = dict(
        model=model,
        dtype="float32",
        max_model_len=512,
        enforce_eager=True,
        block_size=16,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        seed=0,
    )
    options.update(overrides)
    return LLM(**options)


def runner_of(llm):
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner


def assert_drafts_match_the_reference(llm, checkpoint: str, prompts) -> None:
    """Every draft (tokens and confidences) the engine makes while decoding `prompts`
    equals the reference's from the same tokens."""
    from fixtures.reference import ReferenceV41
    from vllm_deepinfer import envs

    model, batch = runner_of(llm).model, runner_of(llm).input_batch
    calls, draft = [], model.draft
    # Every step drafts here (the gate would stop drafts the random weights never get
    # accepted, and the reference is checked at every step).
    gate = runner_of(llm).drafter.gate
    gate.decide = lambda cost, requests, batch: requests

    def recorded(anchors, positions, requests, size):
        tokens, confidences = draft(anchors, positions, requests, size)
        calls.append(
            (
                [batch.req_ids[int(r)] for r in requests],
                positions.tolist(),
                tokens.clone(),
                confidences.clone(),
            )
        )
        return tokens, confidences

    model.draft = recorded
    try:
        outputs = generate(llm, prompts, 8, prompt_logprobs=False)
    finally:
        model.draft = draft
        del gate.decide
    reference = ReferenceV41(checkpoint, torch.float64)
    checked = 0
    for req_ids, positions, tokens, confidences in calls:
        for row, (req_id, anchor) in enumerate(zip(req_ids, positions)):
            output = outputs[int(req_id.split("-")[0])]
            sequence = output.prompt_token_ids + list(output.outputs[0].token_ids)
            if anchor >= len(sequence):
                continue  # the request finished on this step
            # Prompts longer than keep ran decoder-side replay.
            kept_from = max(0, len(output.prompt_token_ids) - envs.DEFAULT_KEEP_TOKENS)
            want_tokens, want_confidences = reference.dspark(
                sequence[: anchor + 1], [anchor], kept_from=kept_from
            )
            assert tokens[row].tolist() == want_tokens[0].tolist(), (req_id, anchor)
            torch.testing.assert_close(
                confidences[row].double(), want_confidences[0], atol=1e-4, rtol=0
            )
            checked += 1
    assert checked >= 5 * len(prompts)  # every request, from its first draft on


def batch_invariant_env(
    switch: str = "DEEPINFER_BATCH_INVARIANT", **settings: str
) -> dict[str, str]:
    """The variables of a batch-invariant engine, `settings` added: the switch (the
    plugin's or vLLM's VLLM_BATCH_INVARIANT) and what it needs where the model runs, as the
    plugin sets them when it is loaded. The engine runs in processes of its own: its worker
    replaces aten's CPU matrix multiplies process-wide (determinism/cpu_ops.py), which
    must not reach the other tests of this process."""
    from vllm_deepinfer import envs
    from vllm_deepinfer.determinism.batch_invariant import process_environment

    with envs.overridden(**{switch: "1"}):
        needed = process_environment(on_cpu=True)
    return {switch: "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1", **needed, **settings}


def close_llm(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def random_prompts(lengths, seed, low: int = 3, high: int = 800) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(low, high, (n,), generator=g).tolist() for n in lengths]


def generate(llm, prompts, new_tokens: int = 10, prompt_logprobs: bool = True):
    """Greedy; prompt logprobs make vLLM recompute the prompt, so prefix-cache tests
    ask for sampled logprobs only."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        max_tokens=new_tokens,
        temperature=0.0,
        logprobs=0,
        prompt_logprobs=0 if prompt_logprobs else None,
        ignore_eos=True,
    )
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)


TIE_TOLERANCE = 5e-5
"""Indexer top-k margins below this are selections the fp32 engine may make either way
(a margin of 8e-6 flipped on one CPU and not on another): `ReferenceRows` also accepts
the reference with such a tie resolved the other way."""
MAX_TIE_VARIANTS = 16


class ReferenceRows:
    """The reference's log-probabilities of `tokens` under `replay` (replays, kept_from),
    rows `first_row` on, with its near ties (ReferenceV41.near_ties): `matches(row,
    check)` asks whether `check` holds for the row as the reference computes it, or,
    failing that, as it computes it with some of the near ties at or before that row
    resolved the other way (a tie changes nothing before its row). Those variants are
    computed only when needed."""

    def __init__(
        self,
        reference,
        tokens: list[int],
        first_row: int = 0,
        tolerance: float = TIE_TOLERANCE,
        **replay,
    ):
        self.reference, self.tokens, self.replay = reference, tokens, replay
        self.first_row, self.tolerance = first_row, tolerance
        self._variants = {frozenset(): self._logprobs(frozenset())}
        self.ties = list(reference.near_ties)

    def _logprobs(self, flipped: frozenset) -> torch.Tensor:
        return (
            self.reference.logits(
                self.tokens,
                last_rows=len(self.tokens) - self.first_row,
                tie_tolerance=self.tolerance,
                flipped=flipped,
                **self.replay,
            )
            .log_softmax(-1)
            .float()
        )  # fp32 halves what the variants hold

    def at(self, row: int, flipped: frozenset = frozenset()) -> torch.Tensor:
        """Row `row` (a token position) of the variant with the ties `flipped` resolved
        the other way (keys of ReferenceV41.near_ties)."""
        if flipped not in self._variants:
            self._variants[flipped] = self._logprobs(flipped)
        return self._variants[flipped][row - self.first_row]

    def matches(self, row: int, check) -> bool:
        if check(self.at(row)):
            return True
        keys = sorted({tie.key for tie in self.ties if tie.row <= row})
        subsets = itertools.chain.from_iterable(
            itertools.combinations(keys, n) for n in range(1, len(keys) + 1)
        )
        return any(
            check(self.at(row, frozenset(flipped)))
            for flipped in itertools.islice(subsets, MAX_TIE_VARIANTS)
        )


def sampled_as_reference(token: int, logprob: float, tolerance: float = LOGPROB_TOLERANCE):
    """A ReferenceRows check: the reference's greedy pick is `token`, at `logprob`."""
    return lambda row: (
        row.argmax().item() == token and abs(row[token].item() - logprob) <= tolerance
    )


def assert_matches_reference(
    reference, prompt, output, tolerance: float = LOGPROB_TOLERANCE, **replay
):
    """Greedy tokens identical; sampled and prompt logprobs within tolerance, the near ties
    of the reference's top-k selections taken either way (ReferenceRows). `replay`: the
    reference's replay arguments (replays, kept_from)."""
    completion = output.outputs[0]
    tokens = list(completion.token_ids)
    first_row = 0 if output.prompt_logprobs else len(prompt) - 1
    rows = ReferenceRows(reference, prompt + tokens[:-1], first_row, **replay)
    for step, (token, entry) in enumerate(zip(tokens, completion.logprobs)):
        row = len(prompt) - 1 + step
        assert rows.matches(row, sampled_as_reference(token, entry[token].logprob, tolerance)), (
            f"step {step}: engine {token} at {entry[token].logprob:.5f}, reference "
            f"{rows.at(row).argmax().item()} and {rows.at(row)[token].item():.5f} "
            f"(near ties {rows.ties})"
        )
    for i, entry in enumerate((output.prompt_logprobs or [None])[1:], start=1):
        logprob = entry[prompt[i]].logprob
        assert rows.matches(
            i - 1,
            lambda row: abs(row[prompt[i]].item() - logprob) <= tolerance,  # noqa: B023 - called here
        ), (
            f"prompt row {i}: engine {logprob:.5f}, reference "
            f"{rows.at(i - 1)[prompt[i]].item():.5f} (near ties {rows.ties})"
        )


def expected_replay(prompt: list[int], hit: int, keep: int, written_under=()) -> dict:
    """The replay vLLM's scheduler decides for an admission with a `hit`-token prefix-cache
    hit: a hit no longer than keep is dropped (recomputed whole), a longer one recomputes
    its last keep tokens; decoder-side replay keeps the last keep prompt rows.

    `written_under`: the replays under which the hit's blocks were computed (the
    `replays` of the admission that wrote them, or of any later one that hit them). A
    replayed admission's compressed KV is approximate, is cached like any other, and is
    what a later hit reads: the chain continues from it. Its replays whose own hits end
    at or beyond this hit wrote none of this hit's blocks."""
    start = hit - keep if hit > keep else 0
    chain = [(s, n) for s, n in written_under if n < hit]
    return dict(
        replays=[*chain, (start, hit)] if start else [], kept_from=max(start, len(prompt) - keep)
    )


SERVER_STARTUP_TIMEOUT_S = 300
SERVER_ARGS = (
    "--dtype",
    "float32",
    "--max-model-len",
    "2048",
    "--enforce-eager",
    "--served-model-name",
    SERVED_NAME,
)
"""What every server the tests start is given: fp32, eager, 2048 tokens, one name."""
# Two local CPU workers (TP=2, DP=2): one core each (vLLM's automatic binding wants a NUMA
# node each).
TWO_WORKERS = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
# EPLB rearranging every few steps, with the plugin's policy, on the tiny model.
EPLB_CONFIG = {
    "window_size": 4,
    "step_interval": 8,
    "num_redundant_experts": 2,
    "log_balancedness": True,
    "policy": "deepinfer",
    "use_async": False,
}


def data_and_expert_parallel_args(**eplb_settings) -> list[str]:
    """`deepinfer serve` arguments for DP=2 + EP with EPLB (EPLB_CONFIG, `eplb_settings`
    replacing its fields) behind one API server; start it with TWO_WORKERS."""
    return [
        "--data-parallel-size",
        "2",
        "--api-server-count",
        "1",
        "--enable-expert-parallel",
        "--enable-eplb",
        "--eplb-config",
        json.dumps({**EPLB_CONFIG, **eplb_settings}),
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_alive(pgid: int) -> bool:
    """Whether any process of the process group `pgid` (a server and its children) lives."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


class RunningServer(str):
    """The base URL of a live server, with the paths of its stdout and stderr and its
    process (a test that stops the server itself signals `process.pid` and waits)."""

    stdout: Path
    stderr: Path
    process: subprocess.Popen


# LD_PRELOAD as the test session found it: an engine built in this process has vLLM's CPU
# platform add torch's libgomp to this process's LD_PRELOAD, which a server would inherit
# (and then, rightly, keep that OpenMP instead of preloading Intel's).
_SESSION_LD_PRELOAD = os.environ.get("LD_PRELOAD")


def session_environment() -> dict[str, str]:
    """This process's environment with LD_PRELOAD as the session began, for processes
    the tests start."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if _SESSION_LD_PRELOAD is not None:
        env["LD_PRELOAD"] = _SESSION_LD_PRELOAD
    return env


def server_env(settings: dict[str, str] | None = None, front_end: bool = True) -> dict[str, str]:
    """The environment of a server a test starts: this one without the test process's own
    vLLM settings (LD_PRELOAD as the session began), 1 GiB of KV space, the `settings`
    added; see `serve` for `front_end`."""
    env = {
        k: v
        for k, v in session_environment().items()
        if k not in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_PLUGINS")
    }
    env.update(VLLM_CPU_KVCACHE_SPACE="1", **(settings or {}))
    if front_end:
        env["VLLM_PLUGINS"] = "deepinfer"
    return env


@contextlib.contextmanager
def serve(
    checkpoint: str,
    log_dir: Path,
    *extra_args: str,
    front_end: bool = True,
    env: dict[str, str] | None = None,
    wait: bool = True,
):
    """`deepinfer serve CHECKPOINT` as a user would start it, stopped by its PID when the
    block ends (whatever of its process group is still there, if the test stopped it).
    With `front_end`, both plugin entry points are on (VLLM_PLUGINS=deepinfer); without
    (for a model that is not V4.1), only the general plugin, which vLLM loads unasked.
    `env`: variables added to the server's environment. Without `wait`, the block starts
    before the server answers: servers started together then wait in `wait_until_served`
    (a start imports vLLM in three processes one after the other, on one core)."""
    port = _free_port()
    env = server_env(env, front_end=front_end)
    command = [
        sys.executable,
        "-m",
        "vllm_deepinfer.serving.cli",
        "serve",
        checkpoint,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *SERVER_ARGS,
        *extra_args,
    ]
    base = RunningServer(f"http://127.0.0.1:{port}")
    base.stdout, base.stderr = log_dir / "stdout.log", log_dir / "stderr.log"
    with open(base.stdout, "w") as out, open(base.stderr, "w") as err:
        process = subprocess.Popen(command, stdout=out, stderr=err, env=env, start_new_session=True)
    base.process = process
    try:
        if wait:
            wait_until_served(base)
        yield base
    finally:
        with contextlib.suppress(ProcessLookupError):  # the group may be gone already
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def wait_until_served(*servers: RunningServer) -> None:
    """Each server answers /health, or the test fails with the first one's log tail."""
    for server in servers:
        failure = wait_until_healthy(server, server.process, SERVER_STARTUP_TIMEOUT_S)
        if failure:
            log = server.stdout.read_text()[-3000:] + server.stderr.read_text()[-3000:]
            pytest.fail(f"{failure}:\n{log}")


def metric(base: str, name: str, **labels: str) -> float:
    """The sum of a /metrics series of the server at `base` over its labels, over those
    with the given label values only when `labels` are given."""
    import requests

    text = requests.get(f"{base}/metrics", timeout=30).text
    wanted = [f'{key}="{value}"' for key, value in labels.items()]
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(name) and all(label in line for label in wanted)
    )


def image_bytes(width: int, height: int, seed: int, fmt: str = "PNG") -> bytes:
    """Random pixels: an image whose encoded size is about its raw size."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt)
    return out.getvalue()


def solid_png(width: int, height: int) -> bytes:
    """Many pixels in few bytes."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), (40, 90, 160)).save(out, "PNG")
    return out.getvalue()


def png_header(width: int, height: int) -> bytes:
    """A PNG that only claims its size (a decompression bomb's header)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
        + chunk(b"IEND", b"")
    )


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


@contextlib.contextmanager
def full_filesystem(mount_point):
    """A 64 KiB tmpfs at `mount_point` with an empty `grammars` directory and no space
    left; skips where mounting is not allowed (not root, no CAP_SYS_ADMIN)."""
    mount_point.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("a full filesystem needs a tmpfs mount: no mount command here")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(
            f"a full filesystem needs a tmpfs mount, refused here: {mounted.stderr.strip()}"
        )
    try:
        (mount_point / "grammars").mkdir()
        fd = os.open(mount_point / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while True:
                os.write(fd, b"\0" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC
        finally:
            os.close(fd)
        yield mount_point / "grammars"
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)


def served_greedy(base: str, prompt: list[int], new_tokens: int) -> tuple[list[int], list]:
    """A served model's greedy tokens for `prompt` and their logprobs (/v1/completions)."""
    import requests

    response = requests.post(
        f"{base}/v1/completions",
        timeout=300,
        json={
            "model": SERVED_NAME,
            "prompt": prompt,
            "max_tokens": new_tokens,
            "temperature": 0,
            "logprobs": 1,
            "return_token_ids": True,
            "ignore_eos": True,
        },
    )
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def assert_single_process_output(reference, prompt, tokens, logprobs) -> None:
    """Served greedy tokens and logprobs are the reference forward's (a parallel layout
    changes nothing beyond the fidelity tolerance)."""
    expected = reference.logits(prompt + tokens[:-1]).log_softmax(-1)[len(prompt) - 1 :]
    assert expected.argmax(-1).tolist() == tokens
    for step, token in enumerate(tokens):
        assert logprobs[step] == pytest.approx(expected[step, token].item(), abs=LOGPROB_TOLERANCE)


def dense_experts(w13, w2, placement=None):
    """Routed experts held dense ([E, 2I, H] and [E, H, I]) in the shape moe.py's grouped
    paths read them, multiplied as the model dtype's experts method multiplies."""
    from vllm_deepinfer.model.deepseek_v41.parallel import ExpertPlacement, TensorSplit
    from vllm_deepinfer.model.deepseek_v41.quantization import RoutedExpertsMethod

    count = w13.shape[0]
    held = types.SimpleNamespace(w13=w13, w2=w2, count=count, method=RoutedExpertsMethod())
    held.placement = placement or ExpertPlacement(count, count, 1, 0, TensorSplit(1, 0))
    held.project = lambda x, which, expert: held.method.apply(held, x, which, expert)
    return held
