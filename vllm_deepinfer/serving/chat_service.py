"""One request through the front end: convert and encode it with deepseek-recipe, run it
on the engine as token ids, and parse the streamed output back with the recipe."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import AsyncIterator

import deepseek_recipe as dr
from vllm import SamplingParams
from vllm.exceptions import VLLMClientError
from vllm.inputs import tokens_input
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

from vllm_deepinfer.serving.prompts import PromptEncoder
from vllm_deepinfer.structured import metrics
from vllm_deepinfer.structured.so_args import (StructuredOutputError, checked_json_schema,
                                               to_structured_outputs)
from vllm_deepinfer.serving.protocols import (ApiProtocol, ChoiceChunk, MultiChoiceResponse,
                                              UsageChunk, recipe_error_message)
from vllm_deepinfer.serving.request_options import (RequestFieldError, read_fields,
                                                     sampling_overrides)

RECIPE_MODEL_NAME = "DeepSeek-V4.1-Flash"
_FINISH = {"stop": dr.InferenceFinishReason.Stop, "length": dr.InferenceFinishReason.Length,
           "repetition": dr.InferenceFinishReason.Stop}


class ApiError(Exception):
    """A request the service refuses, with its HTTP status."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class PreparedRequest:
    protocol: ApiProtocol
    request_id: str
    model: str
    converted: object  # dr.ConversationRequest
    generator_source: object
    prompt_ids: list[int]
    sampling_params: SamplingParams
    stream: bool


def structured_outputs(constraint) -> StructuredOutputsParams | None:
    """The recipe's json / regex output constraint as vLLM structured outputs. Tool-call
    constraints stay unconstrained: the DSML markup they need is made of special tokens,
    which grammar engines do not emit."""
    if constraint is None:
        return None
    if constraint.kind == "json":
        if not constraint.schema:
            return StructuredOutputsParams(json_object=True)
        # The same strict rewrite and up-front checks as so_args (StructuredOutputError).
        return StructuredOutputsParams(json=checked_json_schema(constraint.schema))
    if constraint.kind == "regex":
        return StructuredOutputsParams(regex=constraint.schema)
    return None


class ChatService:
    def __init__(self, engine_client, encoder: PromptEncoder, served_names: list[str],
                 max_model_len: int, compile_pool=None):
        self.engine = engine_client
        self.compile_pool = compile_pool
        self.encoder = encoder
        self.served_names = set(served_names)
        self.max_model_len = max_model_len
        model_config = getattr(engine_client, "model_config", None)
        self.vocab_size = model_config.get_vocab_size() if model_config is not None else None
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
        renamed = {}
        if fields and protocol.adapt_body is not None:
            try:
                adapted = protocol.adapt_body(fields)
            except RequestFieldError as e:
                raise ApiError(400, str(e)) from e
            if adapted is not None:
                body = json.dumps(adapted).encode()
                if "max_completion_tokens" in fields:
                    renamed["max_tokens"] = "max_completion_tokens"
        try:
            request = protocol.request_cls(body)
        except ValueError as e:
            raise ApiError(400, str(e)) from e
        model = request.model
        if model not in self.served_names and model != RECIPE_MODEL_NAME:
            raise ApiError(404, f"The model `{model}` does not exist; this server serves "
                                f"{sorted(self.served_names)}")
        generator_source = None
        try:
            if protocol.request_cls is dr.ResponsesRequest:
                generator_source = (request.namespace_tool_map(self.options), request.echo())
            converted = request.convert(self.options)
        except dr.ConversionError as e:
            raise ApiError(e.status_code, _named(recipe_error_message(e), renamed)) from e
        rendered = self.encoder.encoding.render_conversation(converted.conversation)
        if rendered.image_sources:
            # The vision tower's tensors are loaded past, not run: text only for now.
            raise ApiError(400, "images are not supported yet: vllm-deepinfer serves "
                                "DeepSeek V4.1 text-only")
        ids = self.encoder.encode(converted.conversation, rendered)
        if len(ids) >= self.max_model_len:
            raise ApiError(400, f"This model's maximum context length is {self.max_model_len} "
                                f"tokens; the prompt has {len(ids)}")
        try:
            max_tokens = converted.resolve_max_tokens(len(ids), self.max_model_len)
        except dr.ConversionError as e:
            raise ApiError(e.status_code, _named(recipe_error_message(e), renamed)) from e
        options = converted.inference_options
        structured = self._structured_outputs(fields, options.output_constraint)
        arguments = dict(
            temperature=options.temperature, top_p=options.top_p, seed=options.seed,
            max_tokens=max_tokens,
            logprobs=(options.top_logprobs or 0) if options.logprobs else None)
        arguments.update(sampling_overrides(values, converted.conversation.thinking_mode))
        params = SamplingParams(
            **arguments, structured_outputs=structured,
            output_kind=RequestOutputKind.DELTA, detokenize=False, skip_special_tokens=False)
        return PreparedRequest(protocol, protocol.new_id(), model, converted, generator_source,
                               ids, params, bool(converted.stream))

    @staticmethod
    def _structured_outputs(fields: dict, constraint) -> StructuredOutputsParams | None:
        """DeepInfer's `so_args` extra field, else the recipe's own output constraint."""
        so_args = fields.get("so_args")
        try:
            from_recipe = structured_outputs(constraint)
            if so_args is None:
                return from_recipe
            if from_recipe is not None:
                raise ApiError(400, "use either so_args or the request's response format, "
                                    "not both")
            return to_structured_outputs(so_args)
        except StructuredOutputError as e:
            raise ApiError(400, str(e)) from e

    # --- running ---------------------------------------------------------------------
    def _processor(self, prepared: PreparedRequest):
        generator = prepared.protocol.make_generator(
            prepared.generator_source, prepared.converted, prepared.request_id, prepared.model,
            self.options)
        return dr.StreamProcessor(generator, prepared.converted.parsing_options,
                                  self.encoder.recipe_tokenizer)

    async def events(self, prepared: PreparedRequest) -> AsyncIterator[object]:
        """Protocol events for the request, as the engine produces tokens. Raises ApiError
        if the engine refuses the request before producing anything."""
        await self._compile_grammar(prepared.sampling_params.structured_outputs)
        outputs = self.engine.generate(
            tokens_input(prepared.prompt_ids), prepared.sampling_params, prepared.request_id,
            reasoning_ended=not prepared.converted.conversation.thinking_mode)
        choices = prepared.sampling_params.n
        processors = [self._processor(prepared) for _ in range(choices)]
        usages: list[dict] = []
        last: list[ChoiceChunk] = []

        def per_choice(events, index):
            """The recipe's events as they are for one choice, tagged with their choice
            for several (see protocols.ChoiceChunk)."""
            if choices == 1:
                return events
            tagged = [ChoiceChunk(event, index) for event in events]
            usages.extend(chunk.usage for chunk in tagged if chunk.usage)
            last[:] = tagged[-1:] or last
            return tagged

        ready = engine_done = False
        try:
            async for output in _client_errors_as_api_errors(outputs):
                engine_done = output.finished
                if not ready:
                    ready = True
                    usage = dr.PromptUsage(prompt_tokens=len(prepared.prompt_ids),
                                           prompt_cache_hit_tokens=output.num_cached_tokens or 0)
                    for index, processor in enumerate(processors):
                        for event in per_choice(processor.push(dr.InferenceChunk.ready(
                                prompt_usage=usage, system_fingerprint=None)), index):
                            yield event
                for completion in output.outputs:
                    processor = processors[completion.index]
                    if processor.finished:  # this choice already matched a stop sequence
                        continue
                    for event in per_choice(self._push(prepared, processor, completion),
                                            completion.index):
                        yield event
                if all(processor.finished for processor in processors):
                    break
            for index, processor in enumerate(processors):
                if not processor.finished:
                    for event in per_choice(processor.finish(), index):
                        yield event
            if usages and last:
                yield UsageChunk(last[0], usages)
        finally:
            for processor in processors:
                if not processor.finished:
                    processor.close()
            if not engine_done:  # stop sequences, client gone or error: free the engine
                await self.engine.abort(prepared.request_id)

    @staticmethod
    def _push(prepared: PreparedRequest, processor, completion) -> list:
        """One choice's new tokens (and end) through its stream processor."""
        events = []
        ids = list(completion.token_ids)
        logprobs = _recipe_logprobs(ids, completion.logprobs, prepared.sampling_params.logprobs)
        if (completion.finish_reason == "stop" and ids
                and not isinstance(completion.stop_reason, str)):
            # The EOS / stop token is not part of the answer.
            ids, logprobs = ids[:-1], logprobs and logprobs[:-1]
        if ids:
            events += processor.push(dr.InferenceChunk.tokens(ids, logprobs))
        if processor.finished:  # the recipe matched a stop sequence
            return events
        if completion.finish_reason is not None:
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

    def aggregate(self, prepared: PreparedRequest):
        """The protocol's non-streaming response, filled by accumulating the events."""
        def response():
            return prepared.protocol.response_cls(prepared.request_id, prepared.model,
                                                  int(time.time()), len(prepared.prompt_ids), 0)
        if prepared.sampling_params.n == 1:
            return response()
        return MultiChoiceResponse([response() for _ in range(prepared.sampling_params.n)])


def _json_object(body: bytes) -> dict | None:
    """The body's JSON object; None where it is none (the recipe then says what is wrong)."""
    try:
        fields = json.loads(body)
    except ValueError:
        return None
    return fields if isinstance(fields, dict) else None


def _named(message: str, renamed: dict[str, str]) -> str:
    """A recipe error about a field the request spelled differently, with its own name."""
    for recipe_name, request_name in renamed.items():
        message = message.replace(recipe_name, request_name)
    return message


async def _client_errors_as_api_errors(outputs):
    """The engine's refusals of a request (vLLM client errors) as 400s."""
    try:
        async for output in outputs:
            yield output
    except (VLLMClientError, ValueError) as e:
        raise ApiError(400, str(e)) from e


def _recipe_logprobs(ids: list[int], logprobs, top: int | None) -> list | None:
    """vLLM's per-token {id: Logprob} as the recipe's (logprob, [(id, logprob), ...]) with
    the `top` best alternatives in rank order."""
    if not logprobs or top is None:
        return None
    pairs = []
    for token_id, candidates in zip(ids, logprobs):
        ranked = sorted((rank_lp.rank, i, rank_lp.logprob) for i, rank_lp in candidates.items()
                        if rank_lp.rank is not None and rank_lp.rank <= top)
        pairs.append((candidates[token_id].logprob, [(i, lp) for _, i, lp in ranked]))
    return pairs
