"""The two generation endpoints: parse, check, submit to the engine, answer or stream.

    body -> pydantic model -> SamplingParams + prompt token ids -> AsyncEngine.submit
         -> whole response (JSON with usage)  or  SSE chunks, [usage chunk], [DONE]

A client that goes away cancels its engine requests: the stream's `finally` aborts them,
and a non-streaming handler polls for the disconnect while it waits.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from minserve.errors import (
    GRAMMAR_DEAD_END,
    PromptTooLongError,
    ResumeTokensError,
    StructuredOutputBusyError,
    StructuredOutputError,
)
from minserve.model.tokenizer import Tokenizer
from minserve.outputs import OutputAccumulator, RequestOutput
from minserve.sampling_params import SamplingParams
from minserve.scheduler.policy import priority_value
from minserve.server.admission import RequestRefusedError
from minserve.server.async_engine import (
    AsyncEngine,
    EngineOverloadedError,
    EngineStepError,
    EngineStoppedError,
    RequestsFailedError,
    RequestStream,
)
from minserve.server.body import read_json_body, require_json
from minserve.server.errors import APIError, check_api_key, from_validation
from minserve.server.limits import ServerLimits, check_unused_max_tokens
from minserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    _SamplingRequest,
    check_logit_bias,
)
from minserve.server.responses import ChatFormat, ChoiceFormat, CompletionFormat, sse, usage
from minserve.server.streaming import ChoiceStream, token_counts, whole_pieces, without_output

Prompt = tuple[str | None, list[int]]  # (text if given as text, token ids)


@dataclass(frozen=True)
class ServerConfig:
    """What the HTTP layer enforces on top of the engine's own limits."""

    model_name: str
    api_key: str | None = None
    max_request_bytes: int = 1 << 20  # 1 MiB of JSON
    scheduling_policy: str = "fcfs"
    disconnect_poll_s: float = 0.1  # how often a non-streaming handler checks its client


class OpenAIServing:
    """Handlers for /v1/completions and /v1/chat/completions over one `AsyncEngine`."""

    def __init__(
        self, engine: AsyncEngine, tokenizer: Tokenizer, config: ServerConfig, limits: ServerLimits
    ) -> None:
        self.engine, self.tokenizer, self.config, self.limits = engine, tokenizer, config, limits

    async def completions(self, request: Request) -> Response:
        body = await self._parse(request, CompletionRequest)
        batch = _as_api_error(body.prompts, "prompt")
        self.limits.check_batch(len(batch))  # before tokenizing what could never run
        prompts = [self._tokenize(p) for p in batch]
        fmt = CompletionFormat(self.tokenizer, body.logprobs or 0, body.return_token_ids)
        return await self._serve(request, body, prompts, fmt, "cmpl")

    async def chat(self, request: Request) -> Response:
        body = await self._parse(request, ChatCompletionRequest)
        messages = [m.as_template_message() for m in body.messages]
        text = _as_api_error(lambda: self.tokenizer.apply_chat_template(messages), "messages")
        fmt = ChatFormat(self.tokenizer, body.top_logprobs or 0, body.return_token_ids)
        return await self._serve(request, body, [self._tokenize(text)], fmt, "chatcmpl")

    async def _parse(self, request: Request, model: type[BaseModel]) -> BaseModel:
        check_api_key(request, self.config.api_key)
        require_json(request)
        raw = await read_json_body(request, self.config.max_request_bytes)
        try:
            return model.model_validate_json(raw)
        except ValidationError as error:
            raise from_validation(error) from error

    def _tokenize(self, prompt: str | list[int]) -> Prompt:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)  # as LLM.generate and LLM.chat do
        return None, list(prompt)

    async def _serve(
        self, request: Request, body: _SamplingRequest, prompts: list[Prompt],
        fmt: ChoiceFormat, kind: str,
    ) -> Response:  # fmt: skip
        check_model(body.model, self.config.model_name)
        _as_api_error(body.structured_output_params, body.structured_field)  # names the field
        vocab_size = self.engine.vocab_size
        _as_api_error(lambda: check_logit_bias(body.logit_bias, vocab_size), "logit_bias")
        params = _as_api_error(body.sampling_params, None)
        priority = self._priority(body.priority)
        given = body.max_tokens_param in body.model_fields_set
        self.limits.check([len(ids) for _, ids in prompts], params, body.max_tokens_param, given)
        if body.max_tokens_param != "max_tokens" and body.max_tokens is not None:
            check_unused_max_tokens(self.limits, body.max_tokens, "max_tokens")
        if body.resumes and body.prompt_only:
            raise APIError(400, "max_tokens 0 generates nothing, so nothing continues after "
                           "resume_token_ids", param="resume_token_ids")  # fmt: skip
        stream = await self._submit(prompts, params, priority, body)
        response_id = f"{kind}-{uuid.uuid4().hex}"
        model = self.config.model_name
        if body.stream:
            choice_stream = ChoiceStream(params.n, body.echoes_prompt, body.resumes)
            events = _events(stream, choice_stream, fmt, response_id, model, body)
            return StreamingResponse(events, media_type="text/event-stream")
        outputs: dict[int, RequestOutput] = {}  # prompt index -> its whole output
        drained = _drain(stream, outputs, body.prompt_only)
        finished = await self._wait_unless_disconnected(request, drained, body.structured_field)
        if not finished:
            return Response(status_code=499)  # nobody is listening; nginx's "client closed"
        choices = [fmt.choice(p) for p in whole_pieces(outputs, params.n, body.echoes_prompt)]
        counts = usage(*token_counts(outputs))
        prompt_ids = fmt.prompt_token_ids([outputs[p].prompt_token_ids for p in sorted(outputs)])
        return JSONResponse(fmt.body(response_id, model, fmt.object, choices=choices,
                                     **prompt_ids, usage=counts))  # fmt: skip

    def _priority(self, value: int | str | None) -> int:
        if value is None:
            return 0
        if self.config.scheduling_policy != "priority":
            raise APIError(
                400, "priority needs a server started with --scheduling-policy priority",
                param="priority",
            )  # fmt: skip
        return _as_api_error(lambda: priority_value(value), "priority")

    async def _submit(
        self, prompts: list[Prompt], params: SamplingParams, priority: int, body: _SamplingRequest
    ):
        structured_field = body.structured_field
        try:
            return await self.engine.submit(prompts, params, priority, body.resume_token_ids)
        except ResumeTokensError as e:  # out of range, too long, n > 1, not what a run gives
            raise APIError(400, str(e), param="resume_token_ids") from e
        except PromptTooLongError as e:
            raise APIError(400, str(e), param="prompt", code="context_length_exceeded") from e
        except StructuredOutputBusyError as e:  # runaway compiles hold the compiler's cores
            raise APIError(503, str(e), code="server_overloaded", param=structured_field) from e
        except StructuredOutputError as e:  # the schema, regex or grammar does not compile
            raise APIError(400, str(e), param=structured_field) from e
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from e
        except RequestRefusedError as e:  # it would miss a target: say when to come back
            retry = {"Retry-After": str(e.retry_after_s)}
            raise APIError(503, str(e), code="server_overloaded", headers=retry) from e
        except (EngineOverloadedError, EngineStoppedError) as e:
            raise APIError(503, str(e), code="server_overloaded") from e

    async def _wait_unless_disconnected(
        self, request: Request, work: asyncio.Future, structured_field: str
    ) -> bool:
        task = asyncio.ensure_future(work)
        while not task.done():
            await asyncio.wait({task}, timeout=self.config.disconnect_poll_s)
            if not task.done() and await request.is_disconnected():
                task.cancel()  # _drain's finally aborts the engine requests
                return False
        try:
            task.result()  # re-raise an engine failure
        except (EngineStepError, EngineStoppedError, RequestsFailedError) as error:
            raise _generation_failed(error, structured_field) from error
        return True


def check_model(name: str | None, served: str) -> None:
    """404 unless `name` is the served model's (None: the client left it to the server)."""
    if name is not None and name != served:
        raise APIError(
            404, f"the model {name!r} does not exist; this server serves {served!r}",
            param="model", code="model_not_found",
        )  # fmt: skip


async def _drain(
    stream: RequestStream, outputs: dict[int, RequestOutput], prompt_only: bool
) -> None:
    """Add up every prompt's deltas into `outputs` (prompt index -> whole output);
    `prompt_only`: without the generated tokens (max_tokens 0)."""
    whole = OutputAccumulator()
    try:
        async for prompt_index, delta in stream:
            outputs[prompt_index] = whole.add(without_output(delta) if prompt_only else delta)
    finally:
        stream.abort()


async def _events(
    stream: RequestStream, choices: ChoiceStream, fmt: ChoiceFormat, response_id: str,
    model: str, body: _SamplingRequest,
) -> AsyncIterator[str]:  # fmt: skip
    """SSE chunks, one per choice per step's delta; the final usage chunk
    (stream_options.include_usage) has no choices."""
    try:
        async for prompt_index, delta in stream:
            if body.prompt_only:
                delta = without_output(delta)
            for piece, first in choices.pieces(prompt_index, delta):
                choice = fmt.chunk_choice(piece, first)
                ids = fmt.prompt_token_ids([delta.prompt_token_ids]) if first else {}
                yield sse(fmt.body(response_id, model, fmt.chunk_object, choices=[choice], **ids))
        if body.include_usage:
            counts = usage(choices.prompt_tokens, choices.completion_tokens)
            yield sse(fmt.body(response_id, model, fmt.chunk_object, choices=[], usage=counts))
    except Exception as error:  # headers are sent: report in-band, as OpenAI does
        yield sse(_generation_failed(error, body.structured_field).body())
    finally:
        stream.abort()  # no-op when finished; frees the blocks when the client left
    yield sse("[DONE]")


def _generation_failed(error: Exception, structured_field: str | None = None) -> APIError:
    """A request the engine dropped mid-generation: a 500 (in the body or as an SSE event),
    or a 400 when its structured output's grammar required what the model cannot spell."""
    if isinstance(error, RequestsFailedError) and GRAMMAR_DEAD_END in str(error):
        message = f"the structured output cannot be completed by this model: {error}"
        return APIError(400, message, param=structured_field)
    code = "engine_step_failed" if isinstance(error, EngineStepError) else None
    return APIError(500, f"generation failed: {error}", code=code)


def _as_api_error(make, param: str | None):
    """Call `make()`; a ValueError or TypeError it raises becomes a 400 naming `param`."""
    try:
        return make()
    except (ValueError, TypeError) as error:
        raise APIError(400, str(error), param=param) from error
