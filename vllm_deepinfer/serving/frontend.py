"""`vllm.endpoint_plugins` entry point `deepinfer`: Chat Completions, Responses and Messages
served through deepseek-recipe, replacing vLLM's own routes for a V4.1 model.

Enable with `VLLM_PLUGINS=deepinfer` (that allowlist names entry points of every group,
and both of the plugin's are called `deepinfer`).
"""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from vllm_deepinfer import envs, patches
from vllm_deepinfer.logger import init_logger
from vllm_deepinfer.serving.body_guard import BodyGuard
from vllm_deepinfer.serving.chat_service import ApiError, ChatService, PreparedRequest
from vllm_deepinfer.serving.grammar_cache import register_grammar_cache
from vllm_deepinfer.serving.images import map_large_allocations
from vllm_deepinfer.serving.media import use_by_value_media
from vllm_deepinfer.serving.prompts import PromptEncoder
from vllm_deepinfer.serving.protocols import PROTOCOLS, ApiProtocol
from vllm_deepinfer.structured.compile_pool import GrammarCompilePool

logger = init_logger(__name__)
V41_MODEL_TYPES = ("deepseek_v41", "deepseek_v41_text")


class DeepInferFrontend:
    name = "deepinfer"
    required_tasks = ("generate",)

    def __init__(self):
        self.service: ChatService | None = None
        self._compile_pool: GrammarCompilePool | None = None

    def attach_router(self, app: FastAPI) -> None:
        patches.apply_patch("count_tokens_errors")  # vLLM's own route, served beside these
        for protocol in PROTOCOLS:
            app.add_api_route(protocol.path, self._endpoint(protocol), methods=["POST"])
        app.add_middleware(BodyGuard, skip=tuple(p.path for p in PROTOCOLS))
        # The plugin interface has no shutdown hook; the app's lifespan is where the
        # server's own state is torn down, so the front end's is closed there too.
        app_lifespan = app.router.lifespan_context

        @contextlib.asynccontextmanager
        async def lifespan(app_):
            try:
                async with app_lifespan(app_) as state:
                    yield state
            finally:
                await self.close()

        app.router.lifespan_context = lifespan

    async def close(self) -> None:
        """Stops the grammar compile workers (on server shutdown)."""
        pool, self._compile_pool = self._compile_pool, None
        if pool is not None:
            await asyncio.to_thread(pool.shutdown)
            logger.info("deepinfer front end: grammar compile workers stopped")

    async def init_state(self, engine_client, state, args) -> None:
        model_config = engine_client.model_config
        model_type = getattr(model_config.hf_config, "model_type", None)
        if model_type not in V41_MODEL_TYPES:
            raise RuntimeError(
                f"the deepinfer front end serves DeepSeek V4.1 models, not "
                f"{model_type!r}; leave it out of VLLM_PLUGINS for this model"
            )
        use_by_value_media()
        map_large_allocations()
        served = list(args.served_model_name or [args.model])
        vllm_config = engine_client.vllm_config
        compile_pool = None
        # Without the grammar-cache patch the engine could not read what the pool compiles.
        if (
            vllm_config.structured_outputs_config.backend in ("auto", "xgrammar")
            and register_grammar_cache()
        ):
            compile_pool = GrammarCompilePool(vllm_config, envs.load().grammar_cache_dir)
        self._compile_pool = compile_pool
        self.service = ChatService(
            engine_client,
            PromptEncoder(model_config.tokenizer),
            served,
            model_config.max_model_len,
            compile_pool,
        )
        logger.info("deepinfer front end serves %s for %s", [p.path for p in PROTOCOLS], served)

    def _endpoint(self, protocol: ApiProtocol):
        async def endpoint(raw_request: Request) -> Response:
            return await self.handle(protocol, raw_request)

        endpoint.__name__ = f"deepinfer_{protocol.path.rsplit('/', 1)[-1]}"
        return endpoint

    async def handle(self, protocol: ApiProtocol, raw_request: Request) -> Response:
        """The response; a client that goes away before it is complete (a stream: before
        it starts) cancels the work, which aborts the request in the engine. One gone
        while sending its body is no server error: nothing has started."""
        try:
            body = await raw_request.body()
        except ClientDisconnect:
            return Response(status_code=499)
        work = asyncio.ensure_future(self._respond(protocol, body, raw_request))
        gone = asyncio.ensure_future(_client_gone(raw_request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Stops listening before a StreamingResponse starts listening itself.
            gone.cancel()
            unfinished = not work.done()  # the client went away, or the server stops
            if unfinished:
                work.cancel()
        return Response(status_code=499) if unfinished else work.result()

    async def _respond(self, protocol: ApiProtocol, body: bytes, raw_request: Request) -> Response:
        try:
            # Off the event loop: decoding images and encoding long prompts take time that
            # would stall every stream the server is sending.
            prepared = await asyncio.to_thread(
                self.service.prepare, protocol, body, raw_request.headers.get("content-type", "")
            )
            events = self.service.events(prepared)
            first = await _first_event(events)
        except ApiError as e:
            return JSONResponse(e.body(protocol), status_code=e.status)
        if prepared.stream:
            return StreamingResponse(_sse(protocol, first, events), media_type="text/event-stream")
        return await _complete(self.service, prepared, first, events)


async def _first_event(events):
    """Starts generation, so that the engine's refusal (an ApiError from the service) is
    answered with a status code before any response is sent."""
    try:
        return await events.__anext__()
    except StopAsyncIteration:
        return None


async def _sse(protocol: ApiProtocol, first, events):
    try:
        if first is not None:
            yield protocol.sse(first)
        async for event in events:
            yield protocol.sse(event)
    except ApiError as e:
        yield protocol.sse_error(e.body(protocol))
        return
    done = protocol.sse_done()
    if done:
        yield done


async def _complete(service: ChatService, prepared: PreparedRequest, first, events) -> Response:
    """Aggregates the events into one response."""
    response = service.aggregate(prepared)
    try:
        if first is not None:
            response.accumulate(first)
        async for event in events:
            response.accumulate(event)
    except ApiError as e:
        return JSONResponse(e.body(prepared.protocol), status_code=e.status)
    finally:
        await events.aclose()  # cancelled (client gone): the engine request is aborted
    return Response(response.to_json(), media_type="application/json")


async def _client_gone(raw_request: Request) -> None:
    """Returns when the client disconnects. The body has been read, so the next ASGI
    message is the disconnect: awaited, it is noticed at once, with no polling (as
    vLLM's own routes listen; it notes that Starlette's `is_disconnected` poll does not
    work behind middleware)."""
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass
