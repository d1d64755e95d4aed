"""An engine still running at interpreter exit (an offline `LLM` never shut down) stops
through its client, as `LLM`'s own shutdown would stop it (docs/patches.md).

At exit Python runs weakref finalizers newest first: the process manager's, registered
after its client's, sent SIGTERM and force-killed the engine core 5 s later (the teardown
window never applied), and the client's engine monitor logged "engine core exited
unexpectedly". The patch re-registers the client's finalizer once the client is built, so
it runs first: the client marks its engine stopping, stops it through the process
manager's shutdown (its window) and closes its sockets; the manager's is then detached."""

from __future__ import annotations

import functools
import sys
import weakref

from vllm_deepinfer.patches.base import (
    PatchUnavailable,
    installed,
    left_to_vllm,
    source_of,
    upstream_method,
)

UPSTREAM = "vllm.v1.engine.core_client.MPClient.__init__"
_MARK = "_deepinfer_shutdown_at_exit"
LEFT_TO_VLLM = ""


def _check_upstream() -> type:
    try:
        from vllm.v1.engine import core_client
    except ImportError as exc:
        raise PatchUnavailable(f"vllm.v1.engine.core_client cannot be imported ({exc})") from exc
    client_cls = getattr(core_client, "MPClient", None)
    if client_cls is None:
        raise PatchUnavailable("vllm.v1.engine.core_client.MPClient is missing")
    upstream_method(client_cls, "__init__", UPSTREAM)
    return client_cls


def upstream_client_stops_first(client_cls) -> str:
    """Read from the source (the order shows only at a real interpreter exit): upstream
    does it when the client registers its finalizer after starting its engines."""
    source = source_of(client_cls.__init__, UPSTREAM)
    finalizer, engines = source.rfind("weakref.finalize("), source.find("launch_core_engines(")
    if finalizer == -1 or engines == -1:
        raise PatchUnavailable(
            f"{UPSTREAM} no longer registers a finalizer and then starts "
            "its engines (no 'weakref.finalize(' or 'launch_core_engines('"
            " in its source)"
        )
    if finalizer < engines:
        return ""
    return "registers its engine client's finalizer after its engines' process manager's"


def _wrap_init(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        finalizer = getattr(self, "_finalizer", None)
        if isinstance(finalizer, weakref.finalize) and finalizer.alive:
            _, function, args, kwargs = finalizer.detach()
            self._finalizer = weakref.finalize(self, function, *args, **(kwargs or {}))

    setattr(__init__, _MARK, True)
    return __init__


def apply() -> bool:
    """Idempotent; True once installed, False off the CPU or where upstream's client
    already stops first."""
    from vllm.platforms import current_platform

    global LEFT_TO_VLLM
    client_cls = _check_upstream()
    if not current_platform.is_cpu():
        return False
    if installed(client_cls.__init__, _MARK):
        return True
    does = upstream_client_stops_first(client_cls)
    if does:
        return left_to_vllm(sys.modules[__name__], does)
    LEFT_TO_VLLM = ""
    client_cls.__init__ = _wrap_init(client_cls.__init__)
    return True
