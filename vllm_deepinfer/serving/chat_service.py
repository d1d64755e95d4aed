"""One request through the front end: convert and encode it with deepseek-recipe, run it
on the engine as token ids, and parse the streamed output back with the recipe."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import deepseek_recipe as dr
from vllm import SamplingParams
from vllm.exceptions import VLLMClientError
from vllm.inputs import tokens_input
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
from vllm.v1.engine.exceptions import EngineDeadError

from vllm_deepinfer import envs
from vllm_deepinfer.model.deepseek_v41.args import IMAGE_TOKEN_ID
from vllm_deepinfer.model.deepseek_v41.image_processing import image_span_length
from vllm_deepinfer.serving.images import (
    TRIM_AFTER_PIXELS,
    ImageRejected,
    intake_for,
    refuse_system_message_images,
    release,
    trim_heap,
)
from vllm_deepinfer.serving.prompts import PromptEncoder
from vllm_deepinfer.serving.protocols import (
    RESPONSES,
    AggregatedResponse,
    ApiProtocol,
    ServedChunk,
    UsageChunk,
    recipe_error_message,
)
from vllm_deepinfer.serving.request_options import (
    RequestFieldError,
    read_fields,
    sampling_overrides,
)
from vllm_deepinfer.serving.response_store import ResponseStore, UnknownResponse
from vllm_deepinfer.serving.tool_choice import forced_tool_call
from vllm_deepinfer.serving.usage import TokenCounts, prompt_cache_hits, served_replay_keep
from vllm_deepinfer.structured import metrics
from vllm_deepinfer.structured.json_schema import with_dropped_keywords
from vllm_deepinfer.structured.so_args import (
    StructuredOutputError,
    json_grammar,
    to_structured_outputs,
)

RECIPE_MODEL_NAME = "DeepSeek-V4.1-Flash"
_FINISH = {
    "stop": dr.InferenceFinishReason.Stop,
    "length": dr.InferenceFinishReason.Length,
    "repetition": dr.InferenceFinishReason.Stop,
}


ABORTED = "the engine aborted this request (the server is shutting down); retry it"
ENGINE_STOPPED = (
    "the engine stopped before this request finished (the server is shutting down); retry it"
)
_STORED_STATUSES = ("completed", "incomplete")  # Responses a later request may continue


class ApiError(Exception):
    """A request the service refuses, with its HTTP status."""

    def __init__(
        self, status: int, message: str, code: str | None = None, param: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self, protocol: ApiProtocol) -> dict:
        return protocol.error_body(self.status, self.message, self.code, self.param)


@dataclass
class PreparedRequest:
    protocol: ApiProtocol
    request_id: str
    model: str
    converted: object  # dr.ConversationRequest
    generator_source: object
    prompt_ids: list[int]
    images: list
    """The images (images.OpenedImage: headers read, checked, not decoded), one per image
    token in prompt_ids; decoded, processed and let go in ChatService.engine_input."""
    prompt_length: int  # tokens the engine runs: each image's whole span counted
    sampling_params: SamplingParams
    stream: bool
    counts: TokenCounts
    include_usage: bool
    """Chat streams: usage in a last chunk of its own (stream_options.include_usage)."""
    store_as: dict | None
    """Responses kept for previous_response_id: the request body as run (the
    conversation the reply continues); None when not kept."""
    previous_response_id: str | None
    kv_transfer_params: dict | None = None
    """Sent by a P/D router (context_cache/handoff.py), passed to the engine's KV
    connector."""
    kv_transfer_reply: dict | None = None
    """What the engine's KV connector returned at the end (a prefill's announcement): the
    non-streamed response carries it, as vLLM's own routes do."""


def structured_outputs(
    constraint, tokenizer=None, body: dict | None = None, response_schema=None
) -> StructuredOutputsParams | None:
    """The recipe's output constraint as vLLM structured outputs. A forced tool call is a
    grammar over the DSML markup (tool_choice.py; `tokenizer` is the recipe's, `body` the
    request's fields); `auto` stays unconstrained. `response_schema` is the user's JSON
    Schema as sent: what the recipe's strict normalisation drops is put back."""
    if constraint is None:
        return None
    if constraint.kind == "json":
        if not constraint.schema:
            return StructuredOutputsParams(json_object=True)
        # The same pipeline as so_args (StructuredOutputError).
        schema = json.loads(constraint.schema)
        if response_schema is not None:
            schema = with_dropped_keywords(schema, response_schema)
        return StructuredOutputsParams(grammar=json_grammar(schema))
    if constraint.kind == "regex":
        return StructuredOutputsParams(regex=constraint.schema)
    if constraint.kind in ("tool_call", "tool_call_required"):
        return forced_tool_call(constraint, tokenizer, body or {})
    return None


class ChatService:
    def __init__(
        self,
        engine_client,
        encoder: PromptEncoder,
        served_names: list[str],
        max_model_len: int,
        compile_pool=None,
    ):
        self.engine = engine_client
        self.compile_pool = compile_pool
        self.encoder = encoder
        self.served_names = set(served_names)
        self.max_model_len = max_model_len
        model_config = getattr(engine_client, "model_config", None)
        self.vocab_size = model_config.get_vocab_size() if model_config is not None else None
        self.hf_config = getattr(model_config, "hf_config", None)
        self.images = intake_for(model_config, envs.load())
        self.replay_keep = served_replay_keep(engine_client)  # usage.prompt_cache_hits
        self._decoding = asyncio.Lock()  # engine_input
        self._released_pixels = 0  # decoded since the heap was last trimmed (engine_input)
        self.end_of_thinking = encoder.token_id("</think>")
        self.responses = ResponseStore()
        options = dr.ConversionOptions()
        for name in served_names:
            options = options.with_model_alias(name, dr.ModelVersion.DeepseekV41Flash)
        self.options = options

    # --- request preparation (no engine involved) ------------------------------------
    def prepare(self, protocol: ApiProtocol, body: bytes, content_type: str) -> PreparedRequest:
        if content_type.split(";")[0].strip().lower() != "application/json":
            raise ApiError(415, f"Content-Type must be application/json, got {content_type!r}")
        fields = _json_object(body) or {}
        try:
            values = read_fields(protocol.request_fields, fields, self.vocab_size)
        except RequestFieldError as e:
            raise ApiError(400, str(e)) from e
        renamed = (
            {"max_tokens": "max_completion_tokens"} if "max_completion_tokens" in fields else {}
        )
        as_run = self._adapted(protocol, fields)
        if as_run is not fields:
            body = json.dumps(as_run).encode()
        try:
            request = protocol.request_cls(body)
        except ValueError as e:
            raise ApiError(400, str(e)) from e
        model = request.model
        if model not in self.served_names and model != RECIPE_MODEL_NAME:
            raise ApiError(
                404,
                f"The model `{model}` does not exist; this server serves "
                f"{sorted(self.served_names)}",
                code="model_not_found",
            )
        generator_source = None
        try:
            if protocol.request_cls is dr.ResponsesRequest:
                generator_source = (request.namespace_tool_map(self.options), request.echo())
            converted = request.convert(self.options)
        except dr.ConversionError as e:
            raise ApiError(e.status_code, _named(recipe_error_message(e), renamed)) from e
        rendered = self.encoder.encoding.render_conversation(converted.conversation)
        try:
            refuse_system_message_images(converted.conversation)
            opened = self.images.open(rendered.image_sources)  # headers only
        except ImageRejected as e:
            raise ApiError(400, str(e), code="invalid_image") from e
        ids = self.encoder.encode(converted.conversation, rendered)
        if ids.count(IMAGE_TOKEN_ID) != len(opened):
            raise ApiError(
                400,
                f"the prompt places {ids.count(IMAGE_TOKEN_ID)} images but "
                f"the request sends {len(opened)}",
            )
        # Each image's placeholder becomes its whole span in the engine, sized from the
        # image's header: a prompt too long is refused before any image is decoded.
        prompt_length = len(ids) + sum(
            image_span_length(self.hf_config, item.size) - 1 for item in opened
        )
        if prompt_length >= self.max_model_len:
            raise ApiError(
                400,
                f"This model's maximum context length is {self.max_model_len} "
                f"tokens; the prompt has {prompt_length}",
            )
        try:
            max_tokens = converted.resolve_max_tokens(prompt_length, self.max_model_len)
        except dr.ConversionError as e:
            raise ApiError(e.status_code, _named(recipe_error_message(e), renamed)) from e
        kv_transfer_params = fields.get("kv_transfer_params")
        if kv_transfer_params is not None and not isinstance(kv_transfer_params, dict):
            raise ApiError(400, "kv_transfer_params must be an object", param="kv_transfer_params")
        options = converted.inference_options
        structured = self._structured_outputs(
            fields, options.output_constraint, converted.conversation.response_schema
        )
        arguments = dict(
            temperature=options.temperature,
            top_p=options.top_p,
            seed=options.seed,
            max_tokens=max_tokens,
            logprobs=(options.top_logprobs or 0) if options.logprobs else None,
        )
        arguments.update(sampling_overrides(values, converted.conversation.thinking_mode))
        try:
            params = SamplingParams(
                **arguments,
                structured_outputs=structured,
                output_kind=RequestOutputKind.DELTA,
                detokenize=False,
                skip_special_tokens=False,
            )
        except (VLLMClientError, ValueError) as e:  # vLLM's own checks (n with greedy, ...)
            raise ApiError(400, str(e), param=getattr(e, "parameter", None)) from e
        if kv_transfer_params is not None:
            params.extra_args = {
                **(params.extra_args or {}),
                "kv_transfer_params": kv_transfer_params,
            }
        thinking = converted.conversation.thinking_mode
        counts = TokenCounts(params.n, self.end_of_thinking if thinking else None)
        keep = protocol is RESPONSES and fields.get("store") is not False
        stream_options = fields.get("stream_options")
        include_usage = (
            isinstance(stream_options, dict) and stream_options.get("include_usage") is True
        )
        return PreparedRequest(
            protocol,
            protocol.new_id(),
            model,
            converted,
            generator_source,
            ids,
            opened,
            prompt_length,
            params,
            bool(converted.stream),
            counts,
            include_usage,
            as_run if keep else None,
            fields.get("previous_response_id"),
            kv_transfer_params,
        )

    def _adapted(self, protocol: ApiProtocol, fields: dict) -> dict:
        """The body as the recipe takes it: a Responses request continues its previous
        response, then the protocol's own changes (request_options, documents)."""
        adapted = fields
        try:
            if protocol is RESPONSES:
                adapted = self.responses.continued(fields) or fields
            if adapted and protocol.adapt_body is not None:
                adapted = protocol.adapt_body(adapted) or adapted
        except UnknownResponse as e:
            raise ApiError(
                404,
                f"Previous response with id {e.args[0]!r} not found",
                code="previous_response_not_found",
                param="previous_response_id",
            ) from e
        except RequestFieldError as e:
            raise ApiError(400, str(e)) from e
        except ImageRejected as e:
            raise ApiError(400, str(e), code="invalid_image") from e
        return adapted

    def _structured_outputs(
        self, fields: dict, constraint, response_schema=None
    ) -> StructuredOutputsParams | None:
        """DeepInfer's `so_args` extra field, else the recipe's own output constraint
        (`response_schema`: the user's schema, before the recipe normalised it)."""
        so_args = fields.get("so_args")
        try:
            from_recipe = structured_outputs(
                constraint, self.encoder.recipe_tokenizer, fields, response_schema
            )
            if so_args is None:
                return from_recipe
            if from_recipe is not None:
                raise ApiError(400, "use either so_args or the request's response format, not both")
            return to_structured_outputs(so_args)
        except StructuredOutputError as e:
            raise ApiError(400, str(e)) from e

    # --- running ---------------------------------------------------------------------
    def _processor(self, prepared: PreparedRequest):
        generator = prepared.protocol.make_generator(
            prepared.generator_source,
            prepared.converted,
            prepared.request_id,
            prepared.model,
            self.options,
        )
        return dr.StreamProcessor(
            generator, prepared.converted.parsing_options, self.encoder.recipe_tokenizer
        )

    async def events(self, prepared: PreparedRequest) -> AsyncIterator[object]:
        """Protocol events for the request, as the engine produces tokens. Raises ApiError
        if the engine refuses the request before producing anything."""
        await self._compile_grammar(prepared.sampling_params.structured_outputs)
        prompt = await self.engine_input(prepared)
        outputs = self.engine.generate(
            prompt,
            prepared.sampling_params,
            prepared.request_id,
            reasoning_ended=not prepared.converted.conversation.thinking_mode,
        )
        processors = [self._processor(prepared) for _ in range(prepared.sampling_params.n)]
        usage_template: dict = {}  # the recipe's usage (Chat streams): its prompt figures
        last_chunk: list[dict] = [{}]  # the last Chat chunk sent (its id, model, ...)

        def served(events, index):
            out = []
            for chunk in events:
                data = None
                if prepared.stream:
                    data = self._streamed(
                        prepared, json.loads(chunk.to_json()), index, usage_template
                    )
                    last_chunk[0] = data
                out.append(ServedChunk(chunk, index, data))
            return out

        ready = engine_done = False
        try:
            async for output in _client_errors_as_api_errors(outputs):
                engine_done = output.finished
                if output.finished and output.kv_transfer_params:
                    prepared.kv_transfer_reply = output.kv_transfer_params
                if not ready:
                    ready = True
                    hits = prompt_cache_hits(
                        output.num_cached_tokens, self.replay_keep, prepared.prompt_length
                    )
                    usage = dr.PromptUsage(
                        prompt_tokens=prepared.prompt_length, prompt_cache_hit_tokens=hits
                    )
                    for index, processor in enumerate(processors):
                        for event in served(
                            processor.push(
                                dr.InferenceChunk.ready(prompt_usage=usage, system_fingerprint=None)
                            ),
                            index,
                        ):
                            yield event
                for completion in output.outputs:
                    processor = processors[completion.index]
                    if processor.finished:  # this choice already matched a stop sequence
                        continue
                    for event in served(
                        self._push(prepared, processor, completion), completion.index
                    ):
                        yield event
                if all(processor.finished for processor in processors):
                    break
            for index, processor in enumerate(processors):
                if not processor.finished:
                    for event in served(processor.finish(), index):
                        yield event
            if prepared.include_usage and usage_template:
                yield UsageChunk(
                    {**last_chunk[0], "choices": [], "usage": prepared.counts.usage(usage_template)}
                )
        finally:
            for processor in processors:
                if not processor.finished:
                    processor.close()
            if not engine_done:  # stop sequences, client gone or error: free the engine
                await self.engine.abort(prepared.request_id)

    async def engine_input(self, prepared: PreparedRequest):
        """The prompt as the engine takes it. A request's images are decoded, one at a
        time, and made patches by vLLM's multimodal processing (its renderer, off the
        event loop), then their pixels are let go: the engine needs only the patches, and
        a request may run for minutes. One request at a time does this, server-wide (vLLM
        processes one at a time anyway), so what the server holds decoded is bounded by
        one request's bounds, however many image requests wait."""
        if not prepared.images:
            return tokens_input(prepared.prompt_ids)
        async with self._decoding:
            try:
                images = await asyncio.to_thread(self.images.decode, prepared.images)
                (engine_input,) = await self.engine.renderer.render_cmpl_async(
                    [
                        {
                            "prompt_token_ids": prepared.prompt_ids,
                            "multi_modal_data": {"image": images},
                        }
                    ]
                )
            except ImageRejected as e:
                raise ApiError(400, str(e), code="invalid_image") from e
            except (VLLMClientError, ValueError) as e:
                raise ApiError(400, str(e)) from e
            finally:  # closed: their pixels are freed whoever still refers to them
                self._released_pixels += release(prepared.images)
                if self._released_pixels >= TRIM_AFTER_PIXELS:
                    self._released_pixels = 0
                    await asyncio.to_thread(trim_heap)
        return engine_input

    def _streamed(
        self, prepared: PreparedRequest, data: dict, index: int, usage_template: dict
    ) -> dict:
        """A streamed chunk as sent: Chat chunks carry their choice's index and no usage
        (a last chunk of its own has it, when asked for, as OpenAI streams it); the other
        protocols' events carry usage in their own shape, from the engine's counts."""
        if not prepared.protocol.usage_chunk:
            return self._corrected(prepared, data, index)
        for choice in data.get("choices", ()):
            choice["index"] = index
        usage = data.pop("usage", None)
        if usage:
            usage_template.update(usage)
        if prepared.include_usage:
            data["usage"] = None
        return data

    def _corrected(self, prepared: PreparedRequest, data: dict, index: int | None) -> dict:
        """Response JSON with the engine's token counts (choice `index`, None: all) and,
        for Responses, whether it is stored and what it continues; a finished Responses
        reply (the whole response, streamed or not) is stored here."""
        prepared.counts.rewrite(data, index)
        if index is None and prepared.kv_transfer_reply is not None:
            data["kv_transfer_params"] = prepared.kv_transfer_reply
        response = data.get("response", data)
        if prepared.protocol is RESPONSES and response.get("object") == "response":
            response["store"] = prepared.store_as is not None
            response["previous_response_id"] = prepared.previous_response_id
            if prepared.store_as is not None and response.get("status") in _STORED_STATUSES:
                self.responses.remember(
                    prepared.request_id, prepared.store_as, response.get("output") or []
                )
        return data

    @staticmethod
    def _push(prepared: PreparedRequest, processor, completion) -> list:
        """One choice's new tokens (and end) through its stream processor."""
        events = []
        ids = list(completion.token_ids)
        prepared.counts.add(completion.index, ids)
        logprobs = _recipe_logprobs(ids, completion.logprobs, prepared.sampling_params.logprobs)
        if (
            completion.finish_reason == "stop"
            and ids
            and not isinstance(completion.stop_reason, str)
        ):
            # The EOS / stop token is not part of the answer.
            ids, logprobs = ids[:-1], logprobs and logprobs[:-1]
        if ids:
            events += processor.push(dr.InferenceChunk.tokens(ids, logprobs))
        if processor.finished:  # the recipe matched a stop sequence
            return events
        if completion.finish_reason is not None:
            if completion.finish_reason == "abort":  # not by this service: shutdown
                raise ApiError(503, ABORTED)
            if completion.finish_reason not in _FINISH:
                raise ApiError(500, f"generation ended with {completion.finish_reason}")
            events += processor.push(dr.InferenceChunk.finish(_FINISH[completion.finish_reason]))
            events += processor.finish()
        return events

    async def _compile_grammar(self, params: StructuredOutputsParams | None) -> None:
        """The grammar is compiled (or found cached) outside the engine before the request
        is scheduled; a failure fails this request only."""
        if params is None or self.compile_pool is None:
            return
        try:
            result = await asyncio.wrap_future(self.compile_pool.compile(params))
        except Exception as e:  # noqa: BLE001 - any compile failure is this request's
            raise ApiError(400, f"the output constraint does not compile: {e}") from e
        metrics.record(result)

    def aggregate(self, prepared: PreparedRequest) -> AggregatedResponse:
        """The protocol's non-streaming response, filled by accumulating the events."""
        return AggregatedResponse(
            [self._response(prepared) for _ in range(prepared.sampling_params.n)],
            lambda data: self._corrected(prepared, data, None),
        )

    @staticmethod
    def _response(prepared: PreparedRequest):
        """The recipe's response object of the request's protocol, empty."""
        return prepared.protocol.response_cls(
            prepared.request_id, prepared.model, int(time.time()), prepared.prompt_length, 0
        )


def _json_object(body: bytes) -> dict | None:
    """The body's JSON object; None where it is none (the recipe then says what is wrong)."""
    try:
        fields = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: nested too deeply to read
        return None
    return fields if isinstance(fields, dict) else None


def _named(message: str, renamed: dict[str, str]) -> str:
    """A recipe error about a field the request spelled differently, with its own name."""
    for recipe_name, request_name in renamed.items():
        message = message.replace(recipe_name, request_name)
    return message


async def _client_errors_as_api_errors(outputs):
    """The engine's refusals of a request (vLLM client errors) as 400s; an engine that
    stopped under the request (shutdown) as a 503 the client may retry elsewhere."""
    try:
        async for output in outputs:
            yield output
    except (VLLMClientError, ValueError) as e:
        raise ApiError(400, str(e)) from e
    except EngineDeadError as e:
        raise ApiError(503, ENGINE_STOPPED) from e


def _recipe_logprobs(ids: list[int], logprobs, top: int | None) -> list | None:
    """vLLM's per-token {id: Logprob} as the recipe's (logprob, [(id, logprob), ...]) with
    the `top` best alternatives in rank order."""
    if not logprobs or top is None:
        return None
    pairs = []
    for token_id, candidates in zip(ids, logprobs):
        ranked = sorted(
            (rank_lp.rank, i, rank_lp.logprob)
            for i, rank_lp in candidates.items()
            if rank_lp.rank is not None and rank_lp.rank <= top
        )
        pairs.append((candidates[token_id].logprob, [(i, lp) for _, i, lp in ranked]))
    return pairs
