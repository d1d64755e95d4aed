"""The encoder stage in front of a P/D deployment (E/P/D): the images of each request are
encoded first by the encoder instance, which writes their embeddings to the shared
encoder-cache directory (vLLM's ECExampleConnector); the request then goes on unchanged
to vllm-router, and the prefill and decode instances read the embeddings by the images'
hashes instead of running the vision tower.

    python examples/encoder_front.py --encoder URL --router URL --prefill URL --decode URL

Why a front of our own: vllm-router 0.1.17 from PyPI reaches an encoder stage only
through `--epd-config`, which its Python launcher does not expose (the binary built from
source does, for chat completions only), and it has no `/v1/messages` route. So this
front sends each image to the encoder, then forwards Chat Completions, Completions and
Responses to the router, and carries Messages through the same P/D flow the router uses
(the prefill instance for one token with `kv_transfer_params`, the decode instance with
the prefill's reply). An encoder that is down or refuses an image costs time, not the
answer: the prefill instance finds no embeddings and runs its own vision tower.
"""

import argparse
import asyncio
import json
import logging

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

logger = logging.getLogger("encoder_front")

PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""What vllm-router's vLLM P/D mode sends the prefill instance (its NIXL defaults)."""
HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection"}
DEFAULT_MAX_BODY_BYTES = 128 * 2**20
"""Room for the API server's default 64 MiB of images per request, base64-encoded."""


class BodyTooLarge(Exception):
    pass


async def bounded_body(request: Request, limit: int) -> bytes:
    """The request's body, read no further than `limit` bytes: a client cannot make the
    front hold more than that (the whole body is kept to find its images)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
    return b"".join(chunks)


def image_urls(path: str, body: dict) -> list[str]:
    """The request's images as URLs (http(s) or data:), in order, on each API's shape."""
    if path == "/v1/responses":
        items = body.get("input")
        parts = [
            part
            for item in (items if isinstance(items, list) else [])
            if isinstance(item, dict) and isinstance(item.get("content"), list)
            for part in item["content"]
        ]
        return [
            part["image_url"]
            for part in parts
            if isinstance(part, dict)
            and part.get("type") == "input_image"
            and isinstance(part.get("image_url"), str)
        ]
    messages = body.get("messages")
    parts = [
        part
        for message in (messages if isinstance(messages, list) else [])
        if isinstance(message, dict) and isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, dict)
    ]
    urls = []
    for part in parts:
        if part.get("type") == "image_url":  # Chat Completions
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
        elif part.get("type") == "image" and isinstance(part.get("source"), dict):  # Messages
            source = part["source"]
            url = (
                source.get("url")
                if source.get("type") == "url"
                else f"data:{source.get('media_type')};base64,{source.get('data')}"
            )
        else:
            continue
        if isinstance(url, str):
            urls.append(url)
    return urls


def build_app(
    encoder: str,
    router: str,
    prefill: str,
    decode: str,
    timeout: float,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    transport: httpx.AsyncBaseTransport | None = None,
) -> FastAPI:
    app = FastAPI()
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0), transport=transport)

    async def encode(model: str, url: str) -> None:
        """One image through the encoder instance (one token asked: the encoder-only
        engine finishes the request once the image is encoded and written)."""
        body = {
            "model": model,
            "max_tokens": 1,
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}
            ],
        }
        try:
            reply = await client.post(f"{encoder}/v1/chat/completions", json=body)
            if reply.status_code != 200:
                logger.warning(
                    "the encoder refused an image (%d: %s); the prefill instance encodes it",
                    reply.status_code,
                    reply.text[:200],
                )
        except httpx.HTTPError as exc:
            logger.warning(
                "the encoder is unreachable (%s); the prefill instance encodes the images", exc
            )

    async def relay(method: str, url: str, headers: dict, content: bytes) -> Response:
        """The upstream's answer, streamed through as it comes."""
        upstream = await client.send(
            client.build_request(method, url, headers=headers, content=content), stream=True
        )
        return StreamingResponse(
            upstream.aiter_raw(),
            status_code=upstream.status_code,
            media_type=upstream.headers.get("content-type"),
            background=_closing(upstream),
        )

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def forward(path: str, request: Request) -> Response:
        path = "/" + path
        try:
            content = await bounded_body(request, max_body_bytes)
        except BodyTooLarge:
            return JSONResponse(
                {
                    "error": {
                        "message": f"the request body is over the {max_body_bytes} bytes this "
                        "front takes (--max-body-bytes)",
                        "type": "request_too_large",
                        "code": 413,
                    }
                },
                status_code=413,
            )
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        body = None
        if request.method == "POST" and content:
            try:
                body = json.loads(content)
            except ValueError:
                body = None
        if isinstance(body, dict):
            urls = image_urls(path, body)
            if urls:
                await asyncio.gather(*(encode(body.get("model"), url) for url in urls))
            if path == "/v1/messages":
                return await messages(body, headers)
        return await relay(request.method, f"{router}{path}", headers, content)

    async def messages(body: dict, headers: dict) -> Response:
        """Messages through P/D as the router carries the other APIs."""
        first = await client.post(
            f"{prefill}/v1/messages",
            headers=headers,
            json={**body, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_PARAMS},
        )
        if first.status_code != 200:
            return JSONResponse(first.json(), status_code=first.status_code)
        handoff = first.json().get("kv_transfer_params")
        decode_body = {**body, "kv_transfer_params": handoff} if handoff else body
        return await relay(
            "POST", f"{decode}/v1/messages", headers, json.dumps(decode_body).encode()
        )

    @app.on_event("shutdown")
    async def close() -> None:
        await client.aclose()

    return app


def _closing(upstream: httpx.Response):
    from starlette.background import BackgroundTask

    return BackgroundTask(upstream.aclose)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name in ("encoder", "router", "prefill", "decode"):
        parser.add_argument(f"--{name}", required=True, help=f"the {name}'s base URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--timeout", type=float, default=1800.0, help="seconds an upstream may take to answer"
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="the largest request body taken (larger ones get a 413)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    uvicorn.run(
        build_app(
            args.encoder, args.router, args.prefill, args.decode, args.timeout, args.max_body_bytes
        ),
        host=args.host,
        port=args.port,
        log_level="warning",
    )


if __name__ == "__main__":
    main()
