"""What every patch module raises when the upstream symbol or behaviour it changes is not
there, and the helpers its feature detection uses: they read upstream as it is installed,
never its version string."""

from __future__ import annotations

import dataclasses
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


def upstream_classmethod(owner, name: str, symbol: str, parameters: tuple[str, ...]):
    """The classmethod `owner.name` (`symbol` in messages), checked to take
    (cls, *parameters) as upstream wrote it; raises PatchUnavailable naming what changed."""
    raw = owner.__dict__.get(name)
    if raw is None:
        raise PatchUnavailable(f"{symbol} is missing ({owner.__name__} no longer defines it)")
    if not isinstance(raw, classmethod):
        raise PatchUnavailable(f"{symbol} is no longer a classmethod")
    params = parameter_names(raw.__func__)
    if params[1:] != list(parameters):
        raise PatchUnavailable(
            f"{symbol} now takes ({', '.join(params)}), not (cls, {', '.join(parameters)})"
        )
    return raw


def declare_scheduler_stats_field(name: str, declared) -> bool:
    """Declares one more field `name: declared = None` on vLLM's `SchedulerStats`, so the
    engine core's typed (msgspec) encoding carries it to the front end's stat loggers;
    stats without it encode and decode as before. Idempotent."""
    try:
        from vllm.v1.metrics import stats
    except ImportError as exc:
        raise PatchUnavailable(f"vllm.v1.metrics.stats cannot be imported ({exc})") from exc
    cls = getattr(stats, "SchedulerStats", None)
    if cls is None or not dataclasses.is_dataclass(cls):
        raise PatchUnavailable(
            "vllm.v1.metrics.stats.SchedulerStats is missing or no longer a dataclass"
        )
    fields = cls.__dataclass_fields__
    if name in fields:
        return True
    field = dataclasses.field(default=None)
    field.name, field.type, field._field_type = name, declared, dataclasses._FIELD
    fields[name] = field
    cls.__annotations__[name] = declared
    setattr(cls, name, None)
    return True


def installed(function, mark: str) -> bool:
    """Whether `function` or a function it wraps (its `__wrapped__` chain) carries `mark`:
    a patch is installed once, whatever other patches wrapped the same symbol after it."""
    while function is not None:
        if getattr(function, mark, False):
            return True
        function = getattr(function, "__wrapped__", None)
    return False


# vLLM's configuration classes, each embedding the schemas of those before it: a changed
# field or validator reaches a schema only once it and every class after it are rebuilt.
_EMBEDDING_ORDER = ("EPLBConfig", "ParallelConfig", "SpeculativeConfig", "VllmConfig")


def rebuild_config_schemas(changed: type) -> None:
    """Rebuilds the pydantic schema of vLLM's configuration class `changed` and of every
    configuration class that embeds it (`_EMBEDDING_ORDER`)."""
    import pydantic.dataclasses as pydantic_dataclasses
    import vllm.config as config

    if not hasattr(pydantic_dataclasses, "rebuild_dataclass"):
        raise PatchUnavailable("pydantic.dataclasses.rebuild_dataclass is missing")
    names = _EMBEDDING_ORDER[_EMBEDDING_ORDER.index(changed.__name__) :]
    for name in names:
        cls = getattr(config, name, None)
        if cls is None:
            raise PatchUnavailable(f"vllm.config.{name} is missing")
        pydantic_dataclasses.rebuild_dataclass(cls, force=True)


def upstream_symbols(*symbols: tuple) -> list:
    """Each (module, name)'s value, in order; PatchUnavailable naming the first missing."""
    found = []
    for module, name in symbols:
        value = getattr(module, name, None)
        if value is None:
            raise PatchUnavailable(f"{module.__name__}.{name} is missing")
        found.append(value)
    return found


def upstream_method(cls, name: str, symbol: str):
    """`cls.name` as the class itself defines it (`symbol` in messages)."""
    method = cls.__dict__.get(name)
    if not callable(method) and not isinstance(method, (staticmethod, classmethod)):
        raise PatchUnavailable(f"{symbol} is missing")
    return method


def require_source(function, symbol: str, needed: tuple[tuple[str, str], ...]) -> None:
    """Source reading, where only running processes would show the behaviour: `needed` is
    (text, what upstream no longer does without it) pairs."""
    source = source_of(function, symbol)
    for text, meaning in needed:
        if text not in source:
            raise PatchUnavailable(f"{symbol} no longer {meaning} (no {text!r} in its source)")


def left_to_vllm(module, does: str) -> bool:
    """A patch whose probe found that vLLM does what it restores: records what vLLM does in
    `module.LEFT_TO_VLLM` (the patch report prints it), logs it once per process, and
    returns False (`not needed`)."""
    if getattr(module, "LEFT_TO_VLLM", "") != does:
        from vllm_deepinfer.logger import init_logger

        init_logger("vllm_deepinfer.patches").info(
            "patch %s is not needed: vLLM %s", module.__name__.rpartition(".")[2], does
        )
    module.LEFT_TO_VLLM = does
    return False


def crashes(probe, errors: tuple[type[BaseException], ...]) -> bool:
    """Whether `probe()` (upstream code given a client's bad input) raises one of `errors`,
    which vLLM answers with a 5xx; False where it raises anything else (vLLM's own
    refusal) or nothing."""
    try:
        probe()
    except errors:
        return True
    except Exception:  # noqa: BLE001 - a ValueError or vLLM's own error: a 4xx already
        return False
    return False
