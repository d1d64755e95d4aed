"""vLLM's Ray backends on the CPU: `--distributed-executor-backend ray` and
`--data-parallel-backend ray`.

Why: vLLM places each Ray worker (and each data-parallel engine core) by the platform's
`ray_device_key`, a Ray resource every worker holds one of. vLLM's CPU platform has none,
so both backends refuse to start ("current platform cpu does not support ray"). The patch
gives the CPU platform a custom Ray resource, `deepinfer_cpu` (Ray's own "CPU" cannot be
used: vLLM starts workers with `num_cpus=0` and Ray rejects "CPU" among `resources=`).
Every node of the cluster must advertise it, one unit per worker it may hold:

    ray start --head --resources '{"deepinfer_cpu": 4}'
    ray start --address HEAD:6379 --resources '{"deepinfer_cpu": 4}'

The Ray worker actor reads the ids of its devices from Ray (`get_accelerator_ids()`),
which knows accelerators only and has no entry for a custom resource; the plugin's worker
actor class (a subclass of vLLM's `RayWorkerProc`, which the executor then spawns) has no
device ids to report. Ray ships the actor class by reference, so the subclass is what
the worker processes import, before any plugin is loaded there.

Where the cluster advertises fewer units than the workers need, vLLM's Ray executor waits
for its placement group for 30 minutes (PG_WAIT_TIMEOUT); on the CPU it fails at once,
naming the resource and the `ray start` option. (The data-parallel backend already stops
with "No deepinfer_cpu found in Ray cluster.")

Only vLLM's Ray executor V2 (its default, VLLM_USE_RAY_V2_EXECUTOR_BACKEND=1) is made to
run; the legacy executor's worker wrapper is left as upstream wrote it.

Upstream symbols: vllm.platforms.interface.Platform.ray_device_key (CpuPlatform's is
empty), vllm.v1.executor.ray_executor_v2.RayWorkerProc (get_node_and_physical_gpu_ids;
RayExecutorV2._init_executor spawns `ray.remote(RayWorkerProc)`),
vllm.v1.executor.ray_utils._wait_until_pg_ready; written against vLLM 0.32.

Remove when: vLLM's CPU platform has a Ray device key of its own (`apply()` then reports
`not needed`) and its Ray worker reports device ids for it."""

from __future__ import annotations

import importlib.util
import json

from vllm_deepinfer.patches.base import PatchUnavailable, installed, source_of

UPSTREAM = (
    "vllm.platforms.interface.Platform.ray_device_key, "
    "vllm.v1.executor.ray_executor_v2.RayWorkerProc, "
    "vllm.v1.executor.ray_utils._wait_until_pg_ready"
)
RESOURCE = "deepinfer_cpu"  # the custom Ray resource each CPU worker holds one unit of
_MARK = "_deepinfer_cpu_ray"


def check_upstream():
    """Returns (CpuPlatform, ray_executor_v2, ray_utils); raises PatchUnavailable when a
    symbol or the behaviour the patch relies on has changed."""
    try:
        from vllm.platforms.cpu import CpuPlatform
        from vllm.platforms.interface import Platform
        from vllm.v1.executor import ray_executor_v2, ray_utils
    except ImportError as exc:
        raise PatchUnavailable(
            f"vLLM's CPU platform or Ray executor cannot be imported ({exc})"
        ) from exc
    if not hasattr(Platform, "ray_device_key"):
        raise PatchUnavailable("vllm.platforms.interface.Platform.ray_device_key is missing")
    if getattr(ray_executor_v2, "RayWorkerProc", None) is None:
        raise PatchUnavailable("vllm.v1.executor.ray_executor_v2.RayWorkerProc is missing")
    method = _upstream_worker().__dict__.get("get_node_and_physical_gpu_ids")
    if method is None:
        raise PatchUnavailable("RayWorkerProc.get_node_and_physical_gpu_ids is missing")
    if "get_accelerator_ids" not in source_of(
        method, "RayWorkerProc.get_node_and_physical_gpu_ids"
    ):
        raise PatchUnavailable(
            "RayWorkerProc.get_node_and_physical_gpu_ids no longer reads "
            "Ray's get_accelerator_ids(); re-check what the CPU needs"
        )
    init = getattr(getattr(ray_executor_v2, "RayExecutorV2", None), "_init_executor", None)
    if init is None or "ray.remote(RayWorkerProc)" not in source_of(
        init, "RayExecutorV2._init_executor"
    ):
        raise PatchUnavailable(
            "RayExecutorV2._init_executor no longer spawns "
            "ray.remote(RayWorkerProc) (the module's RayWorkerProc)"
        )
    if getattr(ray_utils, "_wait_until_pg_ready", None) is None:
        raise PatchUnavailable("vllm.v1.executor.ray_utils._wait_until_pg_ready is missing")
    if "_wait_until_pg_ready(" not in source_of(
        ray_utils.initialize_ray_cluster, "ray_utils.initialize_ray_cluster"
    ):
        raise PatchUnavailable(
            "ray_utils.initialize_ray_cluster no longer waits through _wait_until_pg_ready"
        )
    return CpuPlatform, ray_executor_v2, ray_utils


def _upstream_worker():
    """vLLM's RayWorkerProc (the module's, or the one the plugin's class derives from)."""
    from vllm.v1.executor import ray_executor_v2

    worker = ray_executor_v2.RayWorkerProc
    return getattr(worker, "__deepinfer_upstream__", worker)


def _get_node_and_physical_gpu_ids(self) -> tuple[str, list[int]]:
    """(this actor's Ray node id, no device ids): Ray has none for a custom resource."""
    import ray

    return ray.get_runtime_context().get_node_id(), []


_WORKER_CLASS = None


def worker_class():
    """The plugin's Ray worker actor class, `CpuRayWorkerProc`: vLLM's RayWorkerProc,
    reporting no device ids. Built once per process from the upstream class, the same
    way in the engine core that spawns the actors and in the actors' processes, which
    import it (through the module `__getattr__`) from the pickled reference."""
    global _WORKER_CLASS
    if _WORKER_CLASS is None:
        upstream = _upstream_worker()
        _WORKER_CLASS = type(
            "CpuRayWorkerProc",
            (upstream,),
            {
                "__module__": __name__,
                "__qualname__": "CpuRayWorkerProc",
                "__doc__": upstream.__doc__,
                "__deepinfer_upstream__": upstream,
                _MARK: True,
                "get_node_and_physical_gpu_ids": _get_node_and_physical_gpu_ids,
            },
        )
    return _WORKER_CLASS


def __getattr__(name: str):
    if name == "CpuRayWorkerProc":
        return worker_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def require_resource(bundle_specs, cluster_resources) -> None:
    """Raises ValueError when the placement group's bundles need more units of RESOURCE
    than `cluster_resources()` (Ray's totals) advertise: vLLM would wait 30 minutes."""
    needed = sum(bundle.get(RESOURCE, 0) for bundle in bundle_specs or ())
    if not needed:
        return
    available = cluster_resources().get(RESOURCE, 0)
    if available < needed:
        example = json.dumps({RESOURCE: int(needed)})
        raise ValueError(
            f"The Ray cluster advertises {available:g} units of the resource {RESOURCE!r}; "
            f"vLLM's CPU workers need {needed:g} (one each: tensor x pipeline parallel "
            f"size). vllm-deepinfer places CPU workers by that custom resource: start each "
            f"node with `ray start ... --resources '{example}'` (one unit per worker the "
            f"node may hold)."
        )


def apply() -> bool:
    """On the CPU platform: gives it the Ray device key RESOURCE, makes the Ray executor
    spawn the plugin's worker actor class, and fails at once when the cluster lacks the
    resource. Idempotent; returns False (not needed) when the CPU platform already has a
    key of its own or Ray is not installed."""
    CpuPlatform, ray_executor_v2, ray_utils = check_upstream()
    if getattr(ray_executor_v2.RayWorkerProc, _MARK, False):
        return True
    if CpuPlatform.ray_device_key:
        return False  # vLLM's own key: nothing to do
    if importlib.util.find_spec("ray") is None:
        return False  # no Ray backend to enable

    wait = ray_utils._wait_until_pg_ready
    if not installed(wait, _MARK):

        def _wait_until_pg_ready(current_placement_group):
            require_resource(current_placement_group.bundle_specs, ray_utils.ray.cluster_resources)
            return wait(current_placement_group)

        setattr(_wait_until_pg_ready, _MARK, True)
        _wait_until_pg_ready.__wrapped__ = wait
        ray_utils._wait_until_pg_ready = _wait_until_pg_ready
    CpuPlatform.ray_device_key = RESOURCE
    # Ray ships the actor class by reference: its processes import it from this module.
    ray_executor_v2.RayWorkerProc = worker_class()
    return True
