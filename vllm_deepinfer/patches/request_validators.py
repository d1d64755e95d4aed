"""A malformed body on vLLM's own routes is a 400 naming the field, not a 500.

Why: vLLM's request models (`ChatCompletionRequest`, `CompletionRequest`, ...) check
bodies in `mode="before"` model validators that run before pydantic has checked any
field's type, and several read the raw body as if it were well formed:
`check_structured_outputs_count` calls `.get()` on `structured_outputs` (a string there is
an AttributeError), `check_tool_usage` reads `tool["function"]` (a tool without one is a
KeyError). Pydantic turns only ValueError and AssertionError from a validator into a
validation error, so these reach vLLM's catch-all handler: a 500 with a traceback in the
log (`/v1/completions`, `/v1/chat/completions/render`, `/invocations`, ...).

How: in the API server process (where vLLM's app builder is loaded; the routes' body
types are built from the models after the plugins load), each before-validator of vLLM's
request models (subclasses of its `OpenAIBaseModel`) is wrapped: an AttributeError,
KeyError, IndexError or TypeError from it becomes a `VLLMValidationError` (vLLM's own 400,
in its error shape). The error names the field whose value has the wrong type (each field
of the body checked alone against its declared type) and pydantic's reason; where no field
is wrong on its own, the validator and its error. The models are rebuilt so that their
schemas call the wrapped validators.

Upstream symbols: the `mode="before"` model validators of the subclasses of
vllm.entrypoints.serve.engine.protocol.OpenAIBaseModel; probed on
vllm.entrypoints.openai.completion.protocol.CompletionRequest (its
`check_structured_outputs_count`). Written against vLLM 0.32; to report
upstream (a draft is in docs/patches.md: the sandbox has no network).

Remove when: vLLM's before-validators check the types they read (the probe then finds a
validation error, and the patch reports `not needed`)."""

from __future__ import annotations

import functools
import sys

from vllm_deepinfer.patches.base import PatchUnavailable, crashes, left_to_vllm

UPSTREAM = (
    "vllm.entrypoints.serve.engine.protocol.OpenAIBaseModel, "
    "vllm.entrypoints.openai.completion.protocol.CompletionRequest"
)
APP_BUILDER = "vllm.entrypoints.launchers.app"
_MARK = "_deepinfer_request_validators"
_CRASHES = (AttributeError, KeyError, IndexError, TypeError)
# A body the probe sends: `structured_outputs` of the wrong type.
_PROBE = {"model": "m", "prompt": "p", "structured_outputs": "not an object"}


def check_upstream():
    """(OpenAIBaseModel, VLLMValidationError, CompletionRequest) as vLLM defines them."""
    try:
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.entrypoints.serve.engine.protocol import OpenAIBaseModel
        from vllm.exceptions import VLLMValidationError
    except ImportError as exc:
        raise PatchUnavailable(f"vLLM's request models cannot be imported ({exc})") from exc
    if not hasattr(OpenAIBaseModel, "__pydantic_decorators__"):
        raise PatchUnavailable("vLLM's OpenAIBaseModel is no longer a pydantic v2 model")
    return OpenAIBaseModel, VLLMValidationError, CompletionRequest


def _upstream_crashes(completion_request) -> bool:
    """Whether vLLM's own validation of _PROBE crashes instead of refusing it."""
    return crashes(lambda: completion_request.model_validate(_PROBE), _CRASHES)


def _before_validators(cls) -> dict:
    return {
        name: decorator
        for name, decorator in cls.__pydantic_decorators__.model_validators.items()
        if decorator.info.mode == "before"
    }


def _models(base) -> list[type]:
    """Every subclass of `base` with a before-validator, parents first."""
    found, stack = set(), [base]
    while stack:
        for sub in stack.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                stack.append(sub)
    return sorted((cls for cls in found if _before_validators(cls)), key=lambda c: len(c.__mro__))


def wrong_field(model, data) -> tuple[str, str] | None:
    """(path, pydantic's reason) of the first field of `data` whose value does not have
    the type `model` declares for it, checked alone; None if each has."""
    from pydantic import TypeAdapter, ValidationError

    if not isinstance(data, dict):
        return None
    for name, field in model.model_fields.items():
        key = field.alias if field.alias in data else name
        if key not in data:
            continue
        try:
            TypeAdapter(field.annotation).validate_python(data[key])
        except ValidationError as exc:
            error = exc.errors()[0]
            return key + "".join(_path_part(part) for part in error["loc"]), error["msg"]
        except Exception:  # noqa: BLE001 - a type pydantic cannot check alone: skip it
            continue
    return None


def _path_part(part) -> str:
    """`[0]` or `.name`; pydantic's tags of union members (`list[Tool]`) are left out."""
    if isinstance(part, int):
        return f"[{part}]"
    return f".{part}" if str(part).isidentifier() else ""


def _guarded(validator, model, name: str, refusal):
    @functools.wraps(validator)
    def guarded(*args, **kwargs):
        try:
            return validator(*args, **kwargs)
        except _CRASHES as exc:
            data = args[0] if args else kwargs.get("data")
            found = wrong_field(model, data)
            if found is not None:
                path, reason = found
                raise refusal(f"{path}: {reason}", parameter=path) from exc
            raise refusal(
                f"the request is malformed: {model.__name__}'s check {name} failed on it "
                f"({type(exc).__name__}: {exc})"
            ) from exc

    setattr(guarded, _MARK, True)
    return guarded


def apply() -> bool:
    """True once the request models are guarded where this process builds vLLM's HTTP app
    (elsewhere no route parses a body: nothing is changed); False where vLLM refuses the
    probe itself."""
    base, refusal, completion_request = check_upstream()
    probed = _before_validators(completion_request).get("check_structured_outputs_count")
    if probed is None:
        raise PatchUnavailable("CompletionRequest.check_structured_outputs_count is missing")
    if getattr(probed.func, _MARK, False):
        return True
    if not _upstream_crashes(completion_request):
        return left_to_vllm(
            sys.modules[__name__],
            "refuses a before-validated field of the wrong type with a validation error",
        )
    if APP_BUILDER not in sys.modules:
        return True  # an engine core or worker: it parses no request body
    for model in _models(base):
        changed = False
        for name, decorator in _before_validators(model).items():
            if not getattr(decorator.func, _MARK, False):
                decorator.func = _guarded(decorator.func, model, name, refusal)
                changed = True
        if changed:
            model.model_rebuild(force=True)
    if _upstream_crashes(completion_request):
        raise PatchUnavailable("rebuilding vLLM's request models did not take the guard")
    return True
