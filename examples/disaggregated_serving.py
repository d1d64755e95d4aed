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

With `--encoder-cache-dir DIR` it is 1E1P1D: an encoder-only instance (the vision tower
alone, `ec_role` ec_producer) writes image embeddings to DIR through vLLM's
ECExampleConnector, the prefill and decode instances read them (ec_consumer), and
examples/encoder_front.py takes the clients' port: it sends each request's images to the
encoder, then the request to the router (Messages, which the router lacks, through the
same P/D flow itself).

On the CPU the machine's cores are split between the prefill instance (and the encoder)
and the decode instance (VLLM_CPU_OMP_THREADS_BIND, unless it is set or a parallel layout
is asked for).

Arguments after `--` go to every `deepinfer serve` command (e.g. `-- --max-model-len 4096`).
Each process runs in a process group of its own and is stopped by its PID: the router
first (behind the encoder front, if any), then the decode, prefill and encoder instances
(SIGTERM, then SIGKILL after --stop-timeout).
"""

import argparse
import json
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


def core_split() -> dict[str, str] | None:
    """This machine's cores split between the prefill instance (the encoder shares its
    half: it works before the prefill does) and the decode instance, as
    VLLM_CPU_OMP_THREADS_BIND values; None with a single core. vLLM's CPU workers bind
    their OpenMP threads to every core by default: two instances on the same cores spin
    against each other, and on 2 cores a prefill step stalled for a minute."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None
    half = len(cores) // 2
    return {"prefill": ",".join(map(str, cores[:half])), "decode": ",".join(map(str, cores[half:]))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="V4.1 checkpoint directory")
    parser.add_argument(
        "--cache-dir", required=True, help="the context-cache directory both instances share"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="the clients' port")
    parser.add_argument("--prefill-port", type=int, default=8100)
    parser.add_argument("--decode-port", type=int, default=8200)
    parser.add_argument(
        "--encoder-cache-dir",
        default=None,
        help="E/P/D: the image-embedding directory the instances share",
    )
    parser.add_argument("--encoder-port", type=int, default=8300)
    parser.add_argument(
        "--router-port",
        type=int,
        default=8400,
        help="the router's port behind the encoder front (E/P/D only)",
    )
    parser.add_argument(
        "--router-metrics-port",
        type=int,
        default=29000,
        help="the router's Prometheus port (one per deployment on a machine)",
    )
    parser.add_argument(
        "--log-dir",
        default=None,
        help="write each process's output to DIR/{prefill,decode,router}.log",
    )
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--stop-timeout", type=float, default=60.0)
    args, serve_args = parser.parse_known_args()
    serve_args = [a for a in serve_args if a != "--"]

    def url(port: int) -> str:
        return f"http://{args.host}:{port}"

    def start(name: str, command: list[str], env: dict | None = None) -> subprocess.Popen:
        out = None
        if args.log_dir:
            os.makedirs(args.log_dir, exist_ok=True)
            out = open(os.path.join(args.log_dir, f"{name}.log"), "w")
        return subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            start_new_session=True,
            env=env,
        )

    deepinfer = [
        sys.executable,
        "-m",
        "vllm_deepinfer.serving.cli",
        "serve",
        args.model,
        "--host",
        args.host,
    ]

    def encoder_cache(role: str) -> list[str]:
        if not args.encoder_cache_dir:
            return []
        return [
            "--ec-transfer-config",
            json.dumps(
                {
                    "ec_connector": "ECExampleConnector",
                    "ec_role": role,
                    "ec_connector_extra_config": {"shared_storage_path": args.encoder_cache_dir},
                }
            ),
        ]

    instances = [
        (
            "prefill",
            args.prefill_port,
            ["--context-cache-dir", args.cache_dir, *encoder_cache("ec_consumer")],
        ),
        (
            "decode",
            args.decode_port,
            ["--context-cache-dir", args.cache_dir, *encoder_cache("ec_consumer")],
        ),
    ]
    if args.encoder_cache_dir:
        instances.append(("encoder", args.encoder_port, encoder_cache("ec_producer")))
    router_port = args.router_port if args.encoder_cache_dir else args.port
    processes: list[tuple[str, subprocess.Popen]] = []
    stopping = []

    def on_signal(signum, frame):
        stopping.append(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        # One core list per instance: vLLM wants one per worker of a parallel layout.
        parallel = any(
            a.startswith(("--tensor-parallel-size", "-tp", "--data-parallel-size", "-dp"))
            for a in serve_args
        )
        cores = None if parallel else core_split()
        for name, port, flags in instances:
            env = dict(os.environ)
            if cores and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
                env["VLLM_CPU_OMP_THREADS_BIND"] = cores[
                    "decode" if name == "decode" else "prefill"
                ]
            processes.append(
                (name, start(name, [*deepinfer, "--port", str(port), *flags, *serve_args], env))
            )
        deadline = time.monotonic() + args.startup_timeout
        for (name, process), (_, port, _) in zip(processes, instances):
            while not _healthy(url(port)):
                if stopping:
                    return 0
                if process.poll() is not None or time.monotonic() > deadline:
                    print(f"the {name} instance did not start", file=sys.stderr)
                    return 1
                time.sleep(1)
        services = []  # (name, process, port)

        def launch(name: str, port: int, command: list[str]) -> None:
            processes.append((name, start(name, command)))
            services.append((name, processes[-1][1], port))

        launch(
            "router",
            router_port,
            [
                os.path.join(os.path.dirname(sys.executable), "vllm-router"),
                "--vllm-pd-disaggregation",
                "--prefill",
                url(args.prefill_port),
                "--decode",
                url(args.decode_port),
                "--host",
                args.host,
                "--port",
                str(router_port),
                "--prometheus-port",
                str(args.router_metrics_port),
            ],
        )
        if args.encoder_cache_dir:
            launch(
                "front",
                args.port,
                [
                    sys.executable,
                    os.path.join(os.path.dirname(os.path.abspath(__file__)), "encoder_front.py"),
                    "--encoder",
                    url(args.encoder_port),
                    "--router",
                    url(router_port),
                    "--prefill",
                    url(args.prefill_port),
                    "--decode",
                    url(args.decode_port),
                    "--host",
                    args.host,
                    "--port",
                    str(args.port),
                ],
            )
        for name, process, port in services:
            while not _healthy(url(port)):
                if stopping or process.poll() is not None:
                    print(f"the {name} did not start", file=sys.stderr)
                    return 1
                time.sleep(0.5)
        print(
            f"ready: {url(args.port)} ("
            + ", ".join(f"{name} {url(port)}" for name, port, _ in instances)
            + ")",
            flush=True,
        )
        reported = set()
        while not stopping:
            for name, process in processes:
                if process.poll() is None or name in reported:
                    continue
                if name != "encoder":
                    print(
                        f"the {name} process exited ({process.returncode}); stopping",
                        file=sys.stderr,
                    )
                    return 1
                # The prefill instance encodes images itself meanwhile.
                print(
                    f"the encoder exited ({process.returncode}); images are encoded by "
                    "the prefill instance",
                    file=sys.stderr,
                    flush=True,
                )
                reported.add(name)
            time.sleep(0.5)
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for _, process in reversed(processes):  # front, router, instances
            _stop(process, args.stop_timeout)


if __name__ == "__main__":
    sys.exit(main())
