"""What every patch module raises when the upstream symbol or behaviour it changes is not
there, and the helpers its feature detection uses: they read upstream as it is installed,
never its version string."""
from __future__ import annotations

import inspect


class PatchUnavailable(RuntimeError):
    """The upstream symbol or behaviour a patch changes is missing or has changed."""


def source_of(obj, name: str) -> str:
    """The source text of the upstream function `obj` (through any `__wrapped__` chain, so a
    function this plugin already wrapped is read as upstream wrote it)."""
    try:
        return inspect.getsource(inspect.unwrap(obj))
    except (OSError, TypeError) as exc:
        raise PatchUnavailable(f"the source of {name} cannot be read to check it ({exc})") from exc


def parameter_names(func) -> list[str]:
    """The parameter names of the upstream function `func` as written (unwrapped)."""
    return list(inspect.signature(inspect.unwrap(func), follow_wrapped=False).parameters)
