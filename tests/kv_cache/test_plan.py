"""The KV-cache plan `make test-next-vllm` compares across vLLM releases: it covers every
paged cache the model declares, once, in vLLM's own groups; and the comparison fails on a
changed value, not on a field only one release's spec classes have."""

import pytest

from tools.kv_plan import differences, plan

pytestmark = pytest.mark.unit


def test_changed_values_and_new_fields_are_told_apart():
    pinned = {
        "engine": {"block_size": 16, "max_num_active_seqs": None},
        "groups": [{"layers": ["a"], "spec": {"block_size": 16}}],
    }
    other = {
        "engine": {"block_size": 128, "max_num_active_seqs": None},
        "groups": [{"layers": ["a"], "spec": {"block_size": 16, "is_draft": False}}],
    }
    changed, unmatched = differences(pinned, other)
    assert changed == ["engine.block_size: 16 -> 128"]
    assert unmatched == ["groups[0].spec.is_draft: only in the next plan"]
    assert differences(pinned, pinned) == ([], [])
    changed, _ = differences({"groups": [1, 2]}, {"groups": [1]})
    assert changed == ["groups: [1, 2] -> [1]"]


@pytest.mark.engine_config
def test_plan_groups_every_cache_once_at_the_engines_block_size(tiny_checkpoint):
    """vLLM's groups hold each of the model's caches once (a group of several specs lists
    them per layer), each at the block size the engine allocates with."""
    result = plan(tiny_checkpoint)
    layers = [name for group in result["groups"] for name in group["layers"]]
    assert len(layers) == len(set(layers)) > 0
    for group in result["groups"]:
        spec = group["spec"]
        assert (
            sorted(spec.get("kv_cache_specs", {name: spec for name in group["layers"]}))
            == group["layers"]
        )
        assert spec["block_size"] == result["engine"]["block_size"]
    assert {name.rsplit(".", 1)[1] for name in layers} >= {"swa_kv", "compressed_kv", "index_k"}
    assert result["engine"]["worker_cls"].endswith("DeepInferCPUWorker")
