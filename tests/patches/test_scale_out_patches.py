"""The patches that let V4.1 scale out on the CPU: the CPU communicator's variable-size
collectives (vLLM's all-gather/reduce-scatter all-to-all manager needs them), EPLB
accepted on the CPU for V4.1 only, and moe_lb declared in the scheduler stats."""

import types

import pytest
import torch
from vllm.config import VllmConfig
from vllm.config.parallel import ParallelConfig

from vllm_deepinfer.patches import cpu_eplb, cpu_variable_collectives, dspark_stats, eplb_stats

pytestmark = pytest.mark.unit


def _ranks(parts: list[torch.Tensor]):
    """Two ranks' views of a group whose ranks hold `parts`: all_gather concatenates the
    ranks' tensors, all_reduce sums them, as gloo would."""

    def rank(r):
        comm = types.SimpleNamespace(world_size=len(parts), rank_in_group=r)
        comm.all_gather = lambda t, dim: torch.cat(
            [p if i != r else t for i, p in enumerate(comm.peers)], dim
        )
        comm.all_reduce = lambda t: sum(comm.peers[:r] + [t] + comm.peers[r + 1 :])
        return comm

    return [rank(r) for r in range(len(parts))]


def test_variable_all_gather_and_reduce_scatter():
    assert cpu_variable_collectives.apply()
    a, b = torch.arange(4.0).view(2, 2), torch.arange(10.0, 16.0).view(3, 2)
    ranks = _ranks([a, b])
    # all_gatherv: every rank pads its part to the largest before the all-gather.
    for comm, own in zip(ranks, (a, b)):
        comm.peers = [torch.cat([p, p.new_zeros(3 - p.shape[0], 2)]) for p in (a, b)]
        gathered = cpu_variable_collectives.all_gatherv(comm, own, 0, [2, 3])
        assert torch.equal(gathered, torch.cat([a, b]))
        pair = cpu_variable_collectives.all_gatherv(comm, [own, own], 0, [2, 3])
        assert all(torch.equal(t, torch.cat([a, b])) for t in pair)
    # reduce_scatterv: the sum over ranks, each keeping its rows.
    full = [torch.ones(5, 2), 2 * torch.ones(5, 2)]
    for r, comm in enumerate(_ranks(full)):
        comm.peers = full
        mine = cpu_variable_collectives.reduce_scatterv(comm, full[r], 0, [2, 3])
        assert torch.equal(mine, 3 * torch.ones((2, 3)[r], 2))


def test_eplb_is_accepted_on_the_cpu_with_upstreams_other_checks():
    assert cpu_eplb.apply(lambda model_config: False)
    config = ParallelConfig(
        enable_eplb=True,
        enable_expert_parallel=True,
        data_parallel_size=2,
        eplb_config={"num_redundant_experts": 2},
    )
    assert config.eplb_config.use_async is False  # synchronous on the CPU
    assert config.eplb_config.num_redundant_experts == 2
    with pytest.raises(ValueError, match="needs expert parallelism"):
        ParallelConfig(enable_eplb=True, data_parallel_size=2)
    with pytest.raises(ValueError, match="more than one expert-parallel rank"):
        ParallelConfig(enable_eplb=True, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="num_redundant_experts"):  # upstream's, kept
        ParallelConfig(eplb_config={"num_redundant_experts": 2})
    # The platform keeps refusing models the plugin does not serve.
    with pytest.raises(ValueError, match="V4.1 only"):
        VllmConfig(parallel_config=config)


def test_rearrangement_is_timed_with_a_wall_clock():
    start, end = cpu_eplb.WallClockEvent(), cpu_eplb.WallClockEvent()
    start.record()
    end.record()
    end.synchronize()
    assert start.elapsed_time(end) >= 0


def test_moe_lb_travels_in_the_scheduler_stats():
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    # Both stats fields first, as register() declares them before vLLM encodes anything:
    # msgspec keeps the fields SchedulerStats had when the outputs' type was first encoded.
    assert eplb_stats.apply() and dspark_stats.apply()
    stats = SchedulerStats()
    assert stats.deepinfer_moe_lb is None
    stats.deepinfer_moe_lb = [1.2, 1.3, 1.1]
    sent = MsgpackEncoder().encode(EngineCoreOutputs(scheduler_stats=stats))
    received = MsgpackDecoder(EngineCoreOutputs).decode(sent)
    assert received.scheduler_stats.deepinfer_moe_lb == [1.2, 1.3, 1.1]
