"""EPLB at production scale, simulated with the policies' own code: `moe_lb` (busiest
rank's MoE load / mean, per step, all layers together) of vLLM's `default` policy
(DeepSeek's algorithm), the plugin's `deepinfer` policy and no rearrangement, at EP64
and EP128 with Flash's 384 experts (top-6), on Zipf(1.0)-skewed routing traces whose
traffic mix drifts (`tools.eplb_simulator.ZipfDrift`). The engine's window (1000
steps) and interval (3000 steps) are vLLM's defaults. `oracle` is `default` given each
interval's own loads in advance: what sampling noise and drift inside an interval leave.

`measured_ep2` is `moe_lb` as a real engine measures it: `deepinfer serve` of the tiny
checkpoint with `--data-parallel-size 2 --enable-expert-parallel` and EPLB (the plugin's
policy, 2 redundant experts), driven by concurrent requests; the mean of the `moe_lb`
its EP rank 0 logs each step. That run also records its routing trace
(`DEEPINFER_EPLB_TRACE`), and the policies then run on it at EP2 (`recorded`); `--trace
PATH` runs them on another recorded trace instead. `--no-engine` skips the engine."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # fixtures/, tools/

EXPERTS, TOP_K = 384, 6
SCALES = {"ep64": 64, "ep128": 128}


def valid_redundant(experts: int, ranks: int, asked: int) -> int:
    """The smallest redundant count >= `asked` that vLLM accepts: every rank holds the
    same number of physical experts."""
    return -(-(experts + asked) // ranks) * ranks - experts


def oracle(trace: np.ndarray, deployment) -> np.ndarray:
    from vllm.distributed.eplb.policy import DefaultEplbPolicy

    from vllm_deepinfer.eplb.balance import rank_loads, replica_share

    steps, layers, experts = trace.shape
    lbs = np.empty(steps)
    for start in range(0, steps, deployment.interval):
        part = trace[start : start + deployment.interval].astype(np.float64)
        placement = DefaultEplbPolicy.rebalance_experts(
            torch.from_numpy(part.sum(0)), experts + deployment.redundant, 1, 1, deployment.ranks
        ).numpy()
        served = rank_loads(part, replica_share(placement, experts, deployment.ranks))
        lbs[start : start + deployment.interval] = served.max(-1).sum(-1) / served.mean(-1).sum(-1)
    return lbs


def compare(trace: np.ndarray, ranks: int, redundant: int, interval: int, window: int) -> dict:
    """Mean per-step moe_lb of each policy after the first rearrangement."""
    from vllm.distributed.eplb.policy import DefaultEplbPolicy

    from tools.eplb_simulator import Deployment, simulate
    from vllm_deepinfer.eplb.policy import DeepInferEplbPolicy

    deployment = Deployment(ranks=ranks, redundant=redundant, window=window, interval=interval)
    DeepInferEplbPolicy.forget()
    row = {}
    for name, policy in (
        ("none", None),
        ("default", DefaultEplbPolicy),
        ("plugin", DeepInferEplbPolicy),
    ):
        started = time.perf_counter()
        row[name] = round(float(simulate(trace, deployment, policy)[interval:].mean()), 4)
        print(f"  {name:8s} moe_lb {row[name]:.4f}  ({time.perf_counter() - started:.1f} s)")
    # Printed, not in the JSON (which holds exactly the keys).
    print(f"  oracle   moe_lb {float(oracle(trace, deployment)[interval:].mean()):.4f}")
    return row


ENGINE_EPLB = {
    "window_size": 32,
    "step_interval": 64,
    "num_redundant_experts": 2,
    "log_balancedness": True,
    "policy": "deepinfer",
    "use_async": False,
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_ep2(model: str, trace: str, requests_total: int, new_tokens: int) -> float:
    """Mean per-step moe_lb a DP=2 + EP engine with EPLB logs while serving
    `requests_total` requests (8 at a time); its routing trace goes to `trace`."""
    import requests

    from vllm_deepinfer.serving.health import wait_until_healthy

    port = _free_port()
    log_path = trace.replace(".npy", ".log")
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_PLUGINS": "deepinfer",
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",
        "DEEPINFER_EPLB_TRACE": trace,
    }
    command = [
        sys.executable,
        "-m",
        "vllm_deepinfer.serving.cli",
        "serve",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "1024",
        "--enforce-eager",
        "--data-parallel-size",
        "2",
        "--enable-expert-parallel",
        "--enable-eplb",
        "--eplb-config",
        json.dumps(ENGINE_EPLB),
    ]
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    base = f"http://127.0.0.1:{port}"
    try:
        failure = wait_until_healthy(base, server, 600)
        if failure:
            raise RuntimeError(f"{failure}: {log_path}")
        rng = np.random.default_rng(0)

        def one(i: int) -> None:
            prompt = rng.integers(100, 20000, size=int(rng.integers(16, 96))).tolist()
            response = requests.post(
                f"{base}/v1/completions",
                timeout=600,
                json={
                    "model": model,
                    "prompt": prompt,
                    "max_tokens": new_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )
            response.raise_for_status()

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(one, range(requests_total)))
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=120)
    logged = [
        float(v) for v in re.findall(r"EPLB step \d+: moe_lb=([\d.]+)", open(log_path).read())
    ]
    if not logged:
        raise RuntimeError(f"the engine logged no moe_lb: {log_path}")
    print(f"measured_ep2: {len(logged)} logged steps, moe_lb mean {np.mean(logged):.4f}")
    return float(np.mean(logged))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--redundant",
        type=int,
        default=32,
        help="redundant experts asked for (raised to the next count vLLM "
        "accepts: equal physical experts per rank)",
    )
    parser.add_argument(
        "--tokens-per-rank", type=int, default=1024, help="tokens each rank routes per step"
    )
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--intervals",
        type=int,
        default=10,
        help="rearrangement intervals simulated (the first is not scored)",
    )
    parser.add_argument(
        "--drift-period",
        type=int,
        default=100_000,
        help="steps over which the traffic mix drifts by one standard unit",
    )
    parser.add_argument("--window", type=int, default=1000)
    parser.add_argument("--interval", type=int, default=3000)
    parser.add_argument(
        "--trace",
        metavar="PATH",
        help="a recorded trace to run the policies on (instead of the engine run's own)",
    )
    parser.add_argument(
        "--model",
        default="checkpoints/tiny-v41-flash",
        help="the checkpoint the engine measurement serves",
    )
    parser.add_argument("--engine-requests", type=int, default=48)
    parser.add_argument("--engine-new-tokens", type=int, default=48)
    parser.add_argument(
        "--no-engine",
        action="store_true",
        help="skip the engine measurement (measured_ep2, recorded)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the figures to PATH")
    args = parser.parse_args()
    from tools.eplb_simulator import ZipfDrift, load_trace

    results = {}
    for key, ranks in SCALES.items():
        redundant = valid_redundant(EXPERTS, ranks, args.redundant)
        trace = ZipfDrift(
            experts=EXPERTS,
            layers=args.layers,
            top_k=TOP_K,
            tokens=args.tokens_per_rank * ranks,
            exponent=1.0,
            period=args.drift_period,
        ).loads(args.intervals * args.interval)
        print(
            f"{key}: {EXPERTS} experts + {redundant} redundant over {ranks} ranks, "
            f"{args.tokens_per_rank * ranks} tokens a step, {trace.shape[0]} steps"
        )
        results[key] = compare(trace, ranks, redundant, args.interval, args.window)
    trace_path = args.trace
    results["measured_ep2"] = None  # with --no-engine
    if not args.no_engine:
        recorded = os.path.join(tempfile.mkdtemp(prefix="eplb_"), "trace.npy")
        results["measured_ep2"] = round(
            measure_ep2(args.model, recorded, args.engine_requests, args.engine_new_tokens), 4
        )
        trace_path = trace_path or recorded
    if trace_path:
        trace = load_trace(trace_path)
        interval = max(1, trace.shape[0] // 4)
        print(f"recorded {trace_path}: {trace.shape}, EP2, interval {interval}")
        compare(
            trace, 2, valid_redundant(trace.shape[2], 2, 2), interval, max(1, interval // 2)
        )  # printed only
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        from plots import write_plot  # the PNG beside the JSON

        policies = "moe_lb, rearranging policies"
        write_plot(
            args.json,
            "EPLB, simulated: mean moe_lb (busiest rank / mean; 1 is even)",
            {
                "moe_lb": {k: results[k] for k in SCALES},
                policies: {k: {p: results[k][p] for p in ("default", "plugin")} for k in SCALES},
            },
            baselines={policies: 1.0},
        )


if __name__ == "__main__":
    main()
