"""What the shutdown patches' tests share (the fixture is conftest.py's `shutdown_upstream`)."""

import weakref


def installed(parts, module) -> bool:
    """Whether `module`'s wrappers are installed (all of them, or none) on `parts`."""
    mark = f"_deepinfer_{module.__name__.rpartition('.')[2]}"
    marks = set()
    for cls, name in parts[module]:
        method, found = getattr(cls, name), False
        while method is not None and not found:
            found = getattr(method, mark, False)
            method = getattr(method, "__wrapped__", None)
        marks.add(found)
    assert len(marks) == 1, f"{module.__name__} is half installed"
    return marks.pop()


class EngineProcManagerStandIn:
    """vLLM's CoreEngineProcManager as the shutdown patches' wrappers see it: stops its
    engine once, recording the timeouts it was asked for."""

    def __init__(self, request_timeout):
        self._request_shutdown_timeout = request_timeout
        self._finalizer = weakref.finalize(self, lambda: None)
        self.timeouts = []

    def shutdown(self, timeout=None):
        self._finalizer.detach()
        self.timeouts.append(timeout)
