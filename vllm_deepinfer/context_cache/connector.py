"""vLLM's OffloadingConnector, loaded by `kv_connector_module_path`, with the prefill half
of P/D disaggregation: a request a P/D router sends with `do_remote_decode` is answered
with the announcement of the global KV its blocks are being written with
(`handoff.announcement`), which the router hands to the decode instance. Everything else
is the offloading connector's.
"""

from __future__ import annotations

from typing import Any

from typing_extensions import override
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

from vllm_deepinfer.context_cache import handoff
from vllm_deepinfer.context_cache.disk_tier import PersistentDiskTier

CONNECTOR_NAME = "DeepInferOffloadingConnector"
CONNECTOR_MODULE = __name__


class DeepInferOffloadingConnector(OffloadingConnector):
    def _announce(self, request, finished: tuple[bool, dict[str, Any] | None]):
        delay_free, params = finished
        if not handoff.wants_announcement(request.kv_transfer_params):
            return finished
        tiers = getattr(self.scheduler.manager, "secondary_tiers", ())
        disk = next((tier for tier in tiers if isinstance(tier, PersistentDiskTier)), None)
        if disk is None:  # no shared directory to hand the KV over through
            return finished
        return delay_free, {
            **(params or {}),
            **handoff.announcement(disk.layout, request.num_prompt_tokens),
        }

    @override
    def request_finished(self, request, block_ids):
        return self._announce(request, super().request_finished(request, block_ids))

    @override
    def request_finished_all_groups(self, request, block_ids):
        return self._announce(request, super().request_finished_all_groups(request, block_ids))
