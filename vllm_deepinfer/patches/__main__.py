"""`python -m vllm_deepinfer.patches` (`make patch-report`): applies every patch in this
fresh process and prints one line per patch: applied, not needed (and what vLLM does
instead, where a probe found it does), or NOT APPLIED and why.
A report: it always exits 0."""
from __future__ import annotations

import importlib
import logging
import tempfile


def arguments(name: str, scratch_dir: str) -> dict:
    """What each patch's `apply` is given here: what `register()` passes, with harmless
    values (this process serves nothing)."""
    serves_nothing = {"serves_model": lambda model_config: False}
    return {"cpu_platform_config": serves_nothing, "cpu_async_scheduling": serves_nothing,
            "cpu_eplb": serves_nothing, "cpu_compiled_v41": serves_nothing,
            "dspark_v1": serves_nothing, "cpu_spec_sampling": {"on_cpu": True},
            "xgrammar_grammar_cache": {"cache_dir": scratch_dir}}.get(name, {})


def main() -> int:
    try:
        from vllm_deepinfer import patches

        # The lines below say it all; the warnings would repeat them.
        logging.getLogger(patches.LOGGER_NAME).setLevel(logging.ERROR)
        lines = [f"vLLM {patches.vllm_version()}"]
        with tempfile.TemporaryDirectory(prefix="patch-report-") as scratch:
            for patch in patches.INDEX:
                patches.apply_patch(patch.name, **arguments(patch.name, scratch))
                outcome = patches.STATUS[patch.name]
                line = f"  {patch.name:<24} {outcome.state}"
                module = importlib.import_module(f"vllm_deepinfer.patches.{patch.name}")
                if outcome.state == patches.NOT_NEEDED and getattr(module, "LEFT_TO_VLLM", ""):
                    line += f": vLLM {module.LEFT_TO_VLLM}"
                if outcome.reason:
                    line += f": {outcome.reason} (turned off: {patch.feature})"
                lines.append(line)
        print("\n".join(lines), flush=True)
    except Exception as exc:  # noqa: BLE001 - a report, never a failure
        print(f"patch report failed: {type(exc).__name__}: {exc}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
