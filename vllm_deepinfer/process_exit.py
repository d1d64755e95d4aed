"""A process whose work ended cleanly leaves without the interpreter's finalization.

After its exit handlers, the interpreter frees the whole heap: a cyclic-GC scan of all
vLLM built (seconds of CPU on a loaded machine, past a teardown window) and the modules'
teardown, at the end of which Triton's nanobind bindings list every object of theirs
still alive ("nanobind: leaked ...", about 150 lines where the heap was frozen to skip
that scan). Neither does anything the OS does not do at exit.

`leave_after_exit_handlers()` arms an exit handler that runs first: it runs the process's
other exit handlers in their usual order (weakref and multiprocessing finalizers,
logging's flush), flushes stdout and stderr, and ends the process with `os._exit`. Arm it
once the process's teardown has succeeded; the process then ends with that status. Where
a handler was registered after it (it has run already, and would run twice) the process
finishes the usual way instead.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys

# The status to end with and the number of exit handlers once ours was registered.
_armed: dict[str, int] = {}


def supported() -> bool:
    """Whether this interpreter's `atexit` offers what the handler needs."""
    return callable(getattr(atexit, "_run_exitfuncs", None)) and callable(
        getattr(atexit, "_ncallbacks", None)
    )


def leave_after_exit_handlers(status: int = 0) -> bool:
    """At interpreter exit, run the other exit handlers, then `os._exit(status)`. A later
    call moves the handler after every handler registered so far. False where the
    interpreter does not support it (the process exits the usual way)."""
    if not supported():
        return False
    atexit.unregister(_leave)
    atexit.register(_leave)
    _armed.update(status=status, handlers=atexit._ncallbacks())
    return True


def armed() -> bool:
    return bool(_armed)


def _leave() -> None:
    if atexit._ncallbacks() != _armed["handlers"]:
        return  # one registered after ours has run: the rest run the usual way
    atexit.unregister(_leave)
    atexit._run_exitfuncs()  # those registered before ours, newest first
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, OSError, ValueError):  # closed or replaced
            stream.flush()
    os._exit(_armed["status"])
