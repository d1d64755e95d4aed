"""What `make test-next-vllm` checks of the plugin beside a vLLM release other than the
pinned one, in this process:

    python -m tools.compat_check imports    # every plugin module imports, or is skipped
    python -m tools.compat_check register   # vLLM's entry points run; what is off is logged

`imports` imports every module of the installed plugin, read from its folders (a folder
without an `__init__.py` included, which pkgutil would not descend into). A module that
fails only because it imports a part of vLLM's Model Runner V1 that the installed vLLM
does not have (vllm_support.MODEL_RUNNER_V1_MODULES) is skipped, named with that module;
the plugin never imports it there. Any other failure fails the check (exit 1).

`register` runs the general plugin's `register()` (twice, as vLLM's processes do) and the
endpoint plugin's `frontend()`, and prints every line the plugin logs at WARNING or above.
Where vLLM has no Model Runner V1 every feature built on it must be logged as off exactly
once; any exception, or a feature logged twice or never, fails the check (exit 1).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from dataclasses import dataclass, field

ROOTS = ("vllm_deepinfer",)
"""The plugin's packages whose folders are walked."""


def module_names() -> list[str]:
    """Every module of the installed plugin, read from its folders (pkgutil would miss
    a folder without an `__init__.py`)."""
    names = set()
    for root in ROOTS:
        package = importlib.import_module(root)
        for folder in package.__path__:
            for directory, subdirs, files in os.walk(folder):
                subdirs[:] = sorted(d for d in subdirs if d.isidentifier())
                relative = os.path.relpath(directory, folder)
                prefix = root if relative == "." else f"{root}.{relative.replace(os.sep, '.')}"
                names.add(prefix)
                names.update(
                    f"{prefix}.{f[:-3]}"
                    for f in files
                    if f.endswith(".py") and f != "__init__.py" and f[:-3].isidentifier()
                )
    return sorted(names)


@dataclass
class ImportReport:
    imported: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # module -> why
    failed: dict[str, str] = field(default_factory=dict)  # module -> error


def import_all(names: list[str]) -> ImportReport:
    from vllm_deepinfer import vllm_support

    report = ImportReport()
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - each failure is listed
            missing = vllm_support.missing_model_runner_v1_module(exc)
            if missing:
                report.skipped[name] = (
                    f"imports {missing} (Model Runner V1), which this vLLM does not have"
                )
            else:
                report.failed[name] = f"{type(exc).__name__}: {exc}"
        else:
            report.imported.append(name)
    return report


def check_imports() -> int:
    report = import_all(module_names())
    print(f"{len(report.imported)} modules import")
    for name, why in report.skipped.items():
        print(f"  skipped {name}: {why}")
    for name, error in report.failed.items():
        print(f"  FAILED {name}: {error}")
    return 1 if report.failed else 0


def check_register() -> int:
    from vllm_deepinfer import vllm_support

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            lines.append(f"{record.levelname} {record.name}: {record.getMessage()}")

    plugin_logger = logging.getLogger("vllm.deepinfer")
    plugin_logger.addHandler(Collect(logging.WARNING))
    try:
        from vllm_deepinfer.plugins import frontend, register

        register()
        register()
        frontend()
    except Exception as exc:  # noqa: BLE001 - the failure is the report
        print(f"registration FAILED: {type(exc).__name__}: {exc}")
        return 1
    print("register() twice and frontend() ran; the plugin logged:")
    print("\n".join(f"  {line}" for line in lines) or "  nothing at WARNING or above")
    if vllm_support.has_model_runner_v1():
        return 0
    from vllm.platforms import current_platform

    from vllm_deepinfer import envs
    from vllm_deepinfer.model.deepseek_v41.registration import resolve_impl

    # Every feature is registered where the plugin serves V4.1 on the CPU (make
    # test-next-vllm); elsewhere some are never set up, so none may be logged.
    everything = current_platform.is_cpu() and resolve_impl(envs.load().model_impl) == "deepinfer"
    wrong = []
    for feature, text in vllm_support.MODEL_RUNNER_V1_FEATURES.items():
        count = sum(text in line for line in lines)
        if count > 1 or (everything and count == 0):
            wrong.append(f"{feature} logged {count} times")
    if wrong:
        print("Model Runner V1 features not logged once each: " + "; ".join(wrong))
        return 1
    return 0


def main(argv: list[str]) -> int:
    commands = {"imports": check_imports, "register": check_register}
    if len(argv) != 1 or argv[0] not in commands:
        print(__doc__)
        return 2
    return commands[argv[0]]()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
