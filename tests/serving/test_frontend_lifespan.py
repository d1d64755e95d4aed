"""The front end's own state (the grammar compile workers) is stopped when the server's
app shuts down: vLLM's endpoint-plugin interface has no shutdown hook, so the front end
wraps the app's lifespan."""

import asyncio
import contextlib

import pytest
from fastapi import FastAPI

from vllm_deepinfer.serving.frontend import DeepInferFrontend

pytestmark = pytest.mark.unit


def test_compile_pool_stops_with_the_app_and_the_apps_lifespan_still_runs():
    events = []

    @contextlib.asynccontextmanager
    async def server_lifespan(app):
        events.append("server up")
        yield
        events.append("server down")

    class Pool:
        def shutdown(self):
            events.append("pool stopped")

    app = FastAPI(lifespan=server_lifespan)
    frontend = DeepInferFrontend()
    frontend.attach_router(app)
    frontend._compile_pool = Pool()

    async def run():
        async with app.router.lifespan_context(app):
            events.append("serving")

    asyncio.run(run())
    assert events == ["server up", "serving", "server down", "pool stopped"]
    assert {"/v1/chat/completions", "/v1/responses", "/v1/messages"} <= {
        route.path for route in app.routes
    }
