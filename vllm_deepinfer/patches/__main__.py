"""`python -m vllm_deepinfer.patches` (`make patch-report`): applies every patch in this
fresh process and prints one line per patch: applied, not needed (and what vLLM does
instead, where a probe found it does), or NOT APPLIED and why.
A report: it always exits 0."""

from __future__ import annotations

import importlib
import logging
import sys
import tempfile


def arguments(name: str, scratch_dir: str) -> dict:
    """What each patch's `apply` is given here: what `register()` passes, with harmless
    values (this process serves nothing)."""
    serves_nothing = {"serves_model": lambda model_config: False}
    return {
        "cpu_platform_config": serves_nothing,
        "cpu_async_scheduling": serves_nothing,
        "cpu_eplb": serves_nothing,
        "cpu_compiled_v41": serves_nothing,
        "dspark_v1": serves_nothing,
        "cpu_spec_sampling": {"on_cpu": True},
        "xgrammar_grammar_cache": {"cache_dir": scratch_dir},
    }.get(name, {})


def main(argv: list[str] | None = None) -> int:
    """The report. Its first line names the installed vLLM, the supported range and whether
    vLLM has Model Runner V1; a patch of a Model Runner V1 feature on a vLLM without it is
    `not applicable`, its feature off by design. With `--strict` (`make test-next-vllm`)
    it exits 1 when a patch that should apply here does not (NOT APPLIED) or the report
    itself fails; otherwise 0."""
    strict = "--strict" in (sys.argv[1:] if argv is None else argv)
    try:
        from vllm_deepinfer import patches, vllm_support

        # The lines below say it all; the warnings would repeat them.
        logging.getLogger(patches.LOGGER_NAME).setLevel(logging.ERROR)
        logging.getLogger(vllm_support.LOGGER_NAME).setLevel(logging.ERROR)
        installed = vllm_support.installed_vllm()
        in_range = installed is not None and vllm_support.in_supported_range(installed)
        lines = [
            f"vLLM {patches.vllm_version()}; supported: {vllm_support.SUPPORTED_VLLM} "
            f"({'in range' if in_range else 'OUTSIDE it'}); Model Runner V1: "
            f"{'yes' if vllm_support.has_model_runner_v1() else 'no'}"
        ]
        with tempfile.TemporaryDirectory(prefix="patch-report-") as scratch:
            for patch in patches.INDEX:
                patches.apply_patch(patch.name, **arguments(patch.name, scratch))
                outcome = patches.STATUS[patch.name]
                line = f"  {patch.name:<24} {outcome.state}"
                module = importlib.import_module(f"vllm_deepinfer.patches.{patch.name}")
                if outcome.state == patches.NOT_NEEDED and getattr(module, "LEFT_TO_VLLM", ""):
                    line += f": vLLM {module.LEFT_TO_VLLM}"
                if outcome.state == patches.NOT_APPLICABLE:
                    feature = vllm_support.MODEL_RUNNER_V1_FEATURES[
                        patches.MODEL_RUNNER_V1_PATCHES[patch.name]
                    ]
                    line += f": {outcome.reason} (off: {feature})"
                elif outcome.reason:
                    line += f": {outcome.reason} (turned off: {patch.feature})"
                lines.append(line)
        print("\n".join(lines), flush=True)
    except Exception as exc:  # noqa: BLE001 - a report, never a failure
        print(f"patch report failed: {type(exc).__name__}: {exc}", flush=True)
        return 1 if strict else 0
    return 1 if strict and patches.failed() else 0


if __name__ == "__main__":
    raise SystemExit(main())
