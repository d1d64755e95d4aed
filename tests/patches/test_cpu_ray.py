"""Patch cpu_ray: vLLM's Ray backends on the CPU. The CPU platform gets the Ray device key
`deepinfer_cpu`, the Ray executor spawns the plugin's worker actor class (which reports no
device ids, and which Ray ships by reference), and a cluster without enough of the
resource fails at once instead of vLLM's 30-minute placement-group wait. Feature
detection: nothing changes where the CPU platform has a key of its own or Ray is absent.

In-process: upstream is put back after each test (monkeypatch). Served on a real Ray
cluster: tests/distributed/test_ray.py."""

import importlib.util
import inspect
import pickle
from types import SimpleNamespace

import cloudpickle
import pytest

from vllm_deepinfer import patches
from vllm_deepinfer.patches import cpu_ray
from vllm_deepinfer.patches.base import PatchUnavailable

pytestmark = pytest.mark.unit


@pytest.fixture
def upstream(monkeypatch):
    """The CPU platform, Ray executor and placement-group wait as upstream wrote them for
    this test (whatever this process had is put back afterwards)."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.executor import ray_executor_v2, ray_utils

    if "ray_device_key" in CpuPlatform.__dict__:
        monkeypatch.delattr(CpuPlatform, "ray_device_key")
    worker = ray_executor_v2.RayWorkerProc
    monkeypatch.setattr(
        ray_executor_v2, "RayWorkerProc", getattr(worker, "__deepinfer_upstream__", worker)
    )
    monkeypatch.setattr(
        ray_utils, "_wait_until_pg_ready", inspect.unwrap(ray_utils._wait_until_pg_ready)
    )
    monkeypatch.setattr(patches, "STATUS", {})
    return SimpleNamespace(
        platform=CpuPlatform,
        executor=ray_executor_v2,
        utils=ray_utils,
        worker=ray_executor_v2.RayWorkerProc,
    )


def test_applies_where_the_cpu_platform_has_no_ray_key(upstream):
    assert upstream.platform.ray_device_key == ""  # vLLM 0.32: "does not support ray"
    assert patches.apply_patch("cpu_ray") is True
    assert patches.STATUS["cpu_ray"].state == patches.APPLIED
    assert upstream.platform.ray_device_key == cpu_ray.RESOURCE == "deepinfer_cpu"
    worker = upstream.executor.RayWorkerProc
    assert worker is cpu_ray.CpuRayWorkerProc and issubclass(worker, upstream.worker)
    wait = upstream.utils._wait_until_pg_ready
    assert cpu_ray.apply() is True  # idempotent
    assert upstream.executor.RayWorkerProc is worker
    assert upstream.utils._wait_until_pg_ready is wait
    assert inspect.unwrap(wait) is inspect.unwrap(upstream.utils._wait_until_pg_ready)


def test_worker_class_is_shipped_by_reference_and_reports_no_device_ids(upstream, monkeypatch):
    """Ray pickles the actor class by reference; a worker process imports it before any
    plugin runs there: the module builds it from upstream's class on first access."""
    import ray

    cpu_ray.apply()
    worker = upstream.executor.RayWorkerProc
    assert pickle.loads(cloudpickle.dumps(worker)) is worker
    assert b"vllm_deepinfer.patches.cpu_ray" in cloudpickle.dumps(worker)
    monkeypatch.setattr(cpu_ray, "_WORKER_CLASS", None)  # as in a fresh process
    fresh = cpu_ray.CpuRayWorkerProc
    assert fresh is not worker and fresh.__mro__[1] is upstream.worker
    monkeypatch.setattr(
        ray, "get_runtime_context", lambda: SimpleNamespace(get_node_id=lambda: "node-1")
    )
    actor = object.__new__(fresh)  # the method needs no initialized worker
    assert actor.get_node_and_physical_gpu_ids() == ("node-1", [])


def test_not_needed_where_the_cpu_platform_has_a_ray_key(upstream, monkeypatch):
    monkeypatch.setattr(upstream.platform, "ray_device_key", "CPU")
    assert patches.apply_patch("cpu_ray") is True
    assert patches.STATUS["cpu_ray"].state == patches.NOT_NEEDED
    assert upstream.platform.ray_device_key == "CPU"
    assert upstream.executor.RayWorkerProc is upstream.worker


def test_not_needed_without_ray(upstream, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a)
    )
    assert cpu_ray.apply() is False
    assert upstream.platform.ray_device_key == ""


def test_a_cluster_without_the_resource_fails_at_once_naming_it(upstream, monkeypatch):
    waited = []
    monkeypatch.setattr(upstream.utils, "_wait_until_pg_ready", waited.append)
    cpu_ray.apply()
    group = SimpleNamespace(bundle_specs=[{"deepinfer_cpu": 1.0}, {"deepinfer_cpu": 1.0}])
    monkeypatch.setattr(upstream.utils.ray, "cluster_resources", lambda: {"CPU": 2.0})
    with pytest.raises(
        ValueError,
        match=r"advertises 0 units of the resource "
        r"'deepinfer_cpu'.*need 2.*--resources "
        r"'\{\"deepinfer_cpu\": 2\}'",
    ):
        upstream.utils._wait_until_pg_ready(group)
    assert waited == []
    monkeypatch.setattr(upstream.utils.ray, "cluster_resources", lambda: {"deepinfer_cpu": 4.0})
    upstream.utils._wait_until_pg_ready(group)
    assert waited == [group]


def test_require_resource_leaves_other_resources_alone():
    cpu_ray.require_resource([{"GPU": 1.0}, {"GPU": 1.0}], lambda: {})
    cpu_ray.require_resource(None, lambda: {})
    with pytest.raises(ValueError, match="1 units.*need 2"):
        cpu_ray.require_resource([{"deepinfer_cpu": 1.0}] * 2, lambda: {"deepinfer_cpu": 1})


def _changed_worker_method(self):
    return "node", [0]


def _changed_init_executor(self):
    return None


@pytest.mark.parametrize(
    "owner,attribute,replacement,reason",
    [
        (
            "worker",
            "get_node_and_physical_gpu_ids",
            _changed_worker_method,
            "no longer reads Ray's get_accelerator_ids",
        ),
        (
            "executor.RayExecutorV2",
            "_init_executor",
            _changed_init_executor,
            r"no longer spawns ray\.remote\(RayWorkerProc\)",
        ),
    ],
)
def test_unavailable_when_upstream_behaviour_changes(
    upstream, monkeypatch, owner, attribute, replacement, reason
):
    target = upstream
    for part in owner.split("."):
        target = getattr(target, part)
    monkeypatch.setattr(target, attribute, replacement)
    with pytest.raises(PatchUnavailable, match=reason):
        cpu_ray.apply()
    assert patches.apply_patch("cpu_ray") is False
    assert upstream.platform.ray_device_key == ""
    assert upstream.executor.RayWorkerProc is upstream.worker
