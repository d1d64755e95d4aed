"""The count_tokens errors patch: a client error of vLLM's count_tokens handler comes back
as vLLM's error response (the route then logs no traceback); a server error is raised on
as before."""

import asyncio

import pytest

from vllm_deepinfer.patches import count_tokens_errors

pytestmark = pytest.mark.unit


@pytest.fixture
def handler_raising(monkeypatch):
    """AnthropicServingMessages whose original count_tokens raises what the test sets."""
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    raised = {}

    async def count_tokens(self, request, raw_request=None):
        raise raised["error"]

    monkeypatch.setattr(AnthropicServingMessages, "count_tokens", count_tokens)
    assert count_tokens_errors.apply()
    assert count_tokens_errors.apply()  # idempotent: wrapped once
    assert AnthropicServingMessages.count_tokens.__wrapped__ is count_tokens

    def call(error: Exception):
        raised["error"] = error
        handler = AnthropicServingMessages.__new__(AnthropicServingMessages)
        return asyncio.run(handler.count_tokens(None))

    return call


def test_a_client_error_is_returned_as_vllms_error_response(handler_raising):
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse
    from vllm.exceptions import VLLMValidationError

    response = handler_raising(VLLMValidationError("too long", parameter="input_tokens"))
    assert isinstance(response, ErrorResponse)
    assert response.error.code == 400 and response.error.param == "input_tokens"
    assert handler_raising(ValueError("bad")).error.code == 400


def test_a_server_error_goes_on_to_the_route(handler_raising):
    with pytest.raises(RuntimeError, match="engine"):
        handler_raising(RuntimeError("engine"))


def test_not_needed_where_the_route_logs_no_traceback(monkeypatch):
    from vllm.entrypoints.anthropic import api_router

    async def count_tokens(request, raw_request):
        """A route that logs its errors without a traceback."""

    monkeypatch.setattr(api_router, "count_tokens", count_tokens)
    assert count_tokens_errors.apply() is False
