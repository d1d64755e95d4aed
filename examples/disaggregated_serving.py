"""A 1P1D deployment on one machine: a prefill and a decode instance of `deepinfer serve`
sharing one context-cache directory, behind vllm-router's vLLM P/D mode.

    python examples/disaggregated_serving.py --model DIR --cache-dir /shared/kv
    # clients use http://127.0.0.1:8000 (the router); Ctrl-C or SIGTERM stops everything

The router sends each request to the prefill instance for one token, with
`kv_transfer_params: {"do_remote_decode": true}`; the prefill instance writes the prompt's
global KV to the directory and announces it in its reply's `kv_transfer_params`, which the
router passes to the decode instance. The decode instance waits for the announced blocks
(DEEPINFER_PD_KV_WAIT_SECONDS), loads them, recomputes the last
DEEPINFER_YOCO_PREFILL_KEEP_TOKENS tokens of window state itself, and decodes. On many
machines, point every instance at one shared file system and start them with
`deepinfer serve MODEL --context-cache-dir DIR` there.

Arguments after `--` go to both `deepinfer serve` commands (e.g. `-- --max-model-len 4096`).
Each process runs in a process group of its own and is stopped by its PID: the router
first, then the decode and the prefill instance (SIGTERM, then SIGKILL after --stop-timeout).
"""
import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as reply:
            return reply.status == 200
    except OSError:
        return False


def _stop(process: subprocess.Popen, timeout: float) -> None:
    """SIGTERM to the process's group, SIGKILL past `timeout`."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, None)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            print(f"pid {process.pid} outlived {timeout:.0f} s; killing it", file=sys.stderr)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="V4.1 checkpoint directory")
    parser.add_argument("--cache-dir", required=True,
                        help="the context-cache directory both instances share")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="the router's port")
    parser.add_argument("--prefill-port", type=int, default=8100)
    parser.add_argument("--decode-port", type=int, default=8200)
    parser.add_argument("--log-dir", default=None,
                        help="write each process's output to DIR/{prefill,decode,router}.log")
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--stop-timeout", type=float, default=60.0)
    args, serve_args = parser.parse_known_args()
    serve_args = [a for a in serve_args if a != "--"]

    def url(port: int) -> str:
        return f"http://{args.host}:{port}"

    def start(name: str, command: list[str]) -> subprocess.Popen:
        out = None
        if args.log_dir:
            os.makedirs(args.log_dir, exist_ok=True)
            out = open(os.path.join(args.log_dir, f"{name}.log"), "w")
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT if out else None,
                                start_new_session=True)

    deepinfer = [sys.executable, "-m", "vllm_deepinfer.serving.cli", "serve", args.model,
                 "--host", args.host, "--context-cache-dir", args.cache_dir]
    processes: list[tuple[str, subprocess.Popen]] = []
    stopping = []

    def on_signal(signum, frame):
        stopping.append(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        for name, port in (("prefill", args.prefill_port), ("decode", args.decode_port)):
            processes.append((name, start(name, [*deepinfer, "--port", str(port),
                                                 *serve_args])))
        deadline = time.monotonic() + args.startup_timeout
        for (name, process), port in zip(processes, (args.prefill_port, args.decode_port)):
            while not _healthy(url(port)):
                if stopping:
                    return 0
                if process.poll() is not None or time.monotonic() > deadline:
                    print(f"the {name} instance did not start", file=sys.stderr)
                    return 1
                time.sleep(1)
        processes.append(("router", start("router", [
            os.path.join(os.path.dirname(sys.executable), "vllm-router"),
            "--vllm-pd-disaggregation", "--prefill", url(args.prefill_port),
            "--decode", url(args.decode_port), "--host", args.host,
            "--port", str(args.port)])))
        while not _healthy(url(args.port)):
            if stopping or processes[-1][1].poll() is not None:
                print("the router did not start", file=sys.stderr)
                return 1
            time.sleep(0.5)
        print(f"ready: {url(args.port)} (prefill {url(args.prefill_port)}, "
              f"decode {url(args.decode_port)})", flush=True)
        while not stopping:
            for name, process in processes:
                if process.poll() is not None:
                    print(f"the {name} process exited ({process.returncode}); stopping",
                          file=sys.stderr)
                    return 1
            time.sleep(0.5)
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for _, process in reversed(processes):  # router, decode, prefill
            _stop(process, args.stop_timeout)


if __name__ == "__main__":
    sys.exit(main())
