"""`--eplb-config '{"policy": "deepinfer"}'` selects the plugin's EPLB policy.

Why: vLLM keeps its EPLB policies in a registry (`EPLB_POLICIES`, which the EPLB state
reads when it starts), but `EPLBConfig.policy` is typed `Literal["default"]`, so the
configuration refuses any other name before the registry is asked. The policy itself
is added to the registry (the extension point); this patch only widens the field to the
registry's names and rebuilds the configuration classes' validators, so an unknown name
is still refused, now with every registered one listed.

Upstream symbols: vllm.config.parallel.EPLBConfig (field `policy`),
vllm.distributed.eplb.policy.EPLB_POLICIES; written against vLLM 0.32.

Remove when: `EPLBConfig.policy` accepts the names in `EPLB_POLICIES` (then `apply()`
only registers the policy and reports `not needed`)."""

from __future__ import annotations

from typing import Literal, get_args

from vllm_deepinfer.patches.base import PatchUnavailable, rebuild_config_schemas

UPSTREAM = "vllm.config.parallel.EPLBConfig.policy, vllm.distributed.eplb.policy.EPLB_POLICIES"
POLICY_NAME = "deepinfer"


def _upstream():
    try:
        from vllm.config import parallel
        from vllm.distributed.eplb import policy as eplb_policy
    except ImportError as exc:
        raise PatchUnavailable(f"vLLM's EPLB configuration cannot be imported ({exc})") from exc
    registry = getattr(eplb_policy, "EPLB_POLICIES", None)
    if not isinstance(registry, dict):
        raise PatchUnavailable("vllm.distributed.eplb.policy.EPLB_POLICIES is no longer a dict")
    config_class = getattr(parallel, "EPLBConfig", None)
    fields = getattr(config_class, "__dataclass_fields__", {})
    if "policy" not in fields or not hasattr(config_class, "policy"):
        raise PatchUnavailable("vllm.config.parallel.EPLBConfig has no `policy` field")
    return parallel, registry, fields["policy"]


def apply() -> bool:
    """Idempotent. Registers the policy; True when the field had to be widened for it,
    False when vLLM's configuration already accepts it."""
    from vllm_deepinfer.eplb.policy import DeepInferEplbPolicy

    parallel, registry, field = _upstream()
    registry.setdefault(POLICY_NAME, DeepInferEplbPolicy)
    accepted = get_args(field.type)
    if set(registry) <= set(accepted):
        return getattr(parallel.EPLBConfig, "_deepinfer_widened", False)
    field.type = Literal[tuple(registry)]  # type: ignore[valid-type]
    parallel.EPLBConfig.__annotations__["policy"] = field.type
    rebuild_config_schemas(parallel.EPLBConfig)
    parallel.EPLBConfig._deepinfer_widened = True
    return True
