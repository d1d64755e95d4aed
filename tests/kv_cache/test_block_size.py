"""The worker allocates with the block size every paged cache was built with, on every
host: vLLM 0.33 picks the CPU's block size after the model is built
(`Platform.update_block_size_for_backend`), from the attention backends' declarations."""

import pytest
import torch

from tools import kv_plan as plan

pytestmark = [pytest.mark.unit, pytest.mark.engine_config]


def worker_block_size(config) -> int:
    """`cache_config.block_size` as the worker ends with it before allocating."""
    from vllm.platforms import current_platform

    update_block_size = getattr(current_platform, "update_block_size_for_backend", None)
    if update_block_size is not None:
        update_block_size(config)
    return config.cache_config.block_size


@pytest.mark.parametrize("amx", [False, True], ids=["no_amx", "amx"])
def test_the_worker_and_every_cache_spec_agree_on_the_block_size(tiny_checkpoint, amx, monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    config = plan.engine_config(tiny_checkpoint)
    built = {spec.block_size for spec in plan.kv_cache_specs(config).values()}
    assert built == {worker_block_size(config)}
