"""An OpenAI-compatible HTTP server (FastAPI) over an `AsyncLLMEngine`.

``create_app(async_engine, served_model_name=...)`` returns the app; ``scripts/serve.py`` runs it
with uvicorn. Endpoints: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (``stream: true`` sends server-sent events ending ``data: [DONE]``),
``GET /metrics`` (Prometheus). Errors have OpenAI's shape ``{"error": {"message", "type", "param",
"code"}}``: 400 for bad JSON, parameters or prompts (``param`` names the field), 401 without the API
key, 404 for an unknown model, 413 for a body over ``max_body_bytes``, 415 for a POST whose
``Content-Type`` is not JSON (`JSONContentTypeMiddleware`), 503 when ``max_num_seqs``
run and ``max_queued_requests`` already wait (or while draining), 500 when the engine fails a
request. A client that disconnects aborts its requests. Cross-origin (CORS) headers are sent only
to the ``allowed_origins`` given (none by default).

Bodies are read, parsed and validated here (not by FastAPI) so that a body is bounded while it
arrives, a large one is parsed on a worker thread, and a string that is not valid Unicode text is
a 400 naming its field on every route. `drain` is the graceful stop (``scripts/serve.py`` runs it
on SIGTERM): new requests get a 503, those in flight finish or, after the grace period, end with
``finish_reason="abort"``.

Output control (``logit_bias``, ``response_format``, vLLM's ``structured_outputs``,
``allowed_token_ids``, ``bad_words``) is checked against the model here, before the request reaches
the engine: grammars are compiled (and cached) on a worker thread, so a cold compile never stalls the
engine loop, and an invalid schema, regex or bias is a 400 that no other request notices.

Chat takes OpenAI's ``tools`` / ``tool_choice`` and returns ``tool_calls`` and ``reasoning_content``
(`jpaged.agents`: forced calls decode under a grammar, ``"auto"`` output is parsed by
``tool_call_parser``, the ``<think>`` part split off by ``reasoning_parser``).
"""
import asyncio
import contextlib
import hmac
import json
import re
import time
import uuid

import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect

from jpaged.entrypoints.async_engine import (AdmissionError, AsyncLLMEngine, EngineError, QueueFullError,
                                       RequestAbortedError)
from jpaged.agents.chat_output import ChatOutputStream, merge_delta, parse_chat_output
from jpaged.agents.tools import constrained_params
from jpaged.engine.chat_template import apply_chat_template
from jpaged.entrypoints.lora_adapters import ServedAdapters, add_lora_routes
from jpaged.entrypoints.metrics import ServerMetrics
from jpaged.entrypoints.protocol import APIError, ChatCompletionRequest, CompletionRequest, error_response
from jpaged.logger import logger
from jpaged.entrypoints.training_routes import TRAINING_ROUTES, add_training_routes
from jpaged.lora.request import LoRARequest
from jpaged.utils import invalid_text_path, release_free_host_memory

DEFAULT_MAX_BODY_BYTES = 8 * 2**20  # a request body larger than this is a 413
INLINE_BODY_BYTES = 64 * 2**10      # larger bodies are parsed on a worker thread, off the event loop
DISCARD_BYTES = 64 * 2**20          # a body over the limit is read (and dropped) up to this, then cut


REQUEST_FIELDS = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)


STRUCTURED_PARAMS = ("structured_outputs", "response_format", "StructuredOutputsParams")
# an engine limit a request exceeds -> the request field that asks for too much
LIMIT_PARAMS = {"max_num_seqs": "n", "max_num_batched_tokens": "n", "num_kv_blocks": "max_tokens"}


def bad_request(e: ValueError, prompt_param: str = "prompt", structured_param: str = "structured_outputs") -> APIError:
    """A 400 naming the request field the ValueError names (``SamplingParams.top_p=...`` -> ``top_p``);
    structured-output errors name the field the request used (``response_format`` or ``structured_outputs``)."""
    message = str(e)
    m = re.match(r"(?:prompts?\[\d+\]: )?(?:SamplingParams\.)?(\w+)", message)
    param = m.group(1) if m else None
    if param in ("prompt", "prompt_token_ids", "chat", "chat_template", "messages"):
        param = prompt_param
    elif param in STRUCTURED_PARAMS:
        param = structured_param
    param = LIMIT_PARAMS.get(param, param)
    return APIError(400, message, param=param if param in REQUEST_FIELDS else None)


def validation_error(e: pydantic.ValidationError, prefix: int = 0) -> APIError:
    """A 400 naming the field of pydantic's first error (``loc[prefix:]``)."""
    first = (e.errors() or [{}])[0]
    loc = [str(x) for x in first.get("loc", ())[prefix:]]
    message = first.get("msg", "invalid request")
    return APIError(400, f"{'.'.join(loc)}: {message}" if loc else message, param=loc[0] if loc else None)


def parse_body(body: bytes, model: type[pydantic.BaseModel]):
    """The request ``model`` from a JSON body; an APIError (400 naming the field) if it is not one."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as e:  # bad JSON, bad UTF-8, too deep, an int of 5,000 digits
        raise APIError(400, f"Invalid JSON body: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"Invalid body: expected a JSON object, got {type(data).__name__}")
    for field in model.model_fields:
        path = invalid_text_path(data[field], field) if field in data else None
        if path is not None:
            raise APIError(400, f"{path}: not valid Unicode text (it holds a lone surrogate such as '\\ud800'); "
                                "send UTF-8 text", param=field)
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as e:
        raise validation_error(e) from None
    except RecursionError:
        raise APIError(400, "Invalid body: nested too deeply") from None


async def read_body(raw: Request, limit: int) -> bytes:
    """The body, or a 413 when it exceeds ``limit`` bytes. Nothing past the limit is kept, but up to
    ``DISCARD_BYTES`` are read and dropped first: a client still sending when the connection closes
    would see a reset, not the 413."""
    def too_large(size):
        return APIError(413, f"Request body of {size} bytes is larger than the server's limit of {limit} bytes "
                             "(--max_request_body_bytes)", code="request_too_large")

    length = raw.headers.get("content-length", "")
    if length.isascii() and length.isdigit() and int(length) > max(limit, DISCARD_BYTES):
        raise too_large(int(length))
    chunks, size = [], 0
    try:
        async for chunk in raw.stream():
            size += len(chunk)
            if size <= limit:
                chunks.append(chunk)
            elif size > DISCARD_BYTES:
                break
            else:
                chunks.clear()
    except ClientDisconnect:  # nobody is left to answer: one line, not a traceback
        logger.info("%s %s: the client disconnected after %d of %s body bytes", raw.method, raw.url.path, size,
                    length or "its")
        raise APIError(499, "client disconnected while sending the request body") from None
    if size > limit:
        raise too_large(size if size <= DISCARD_BYTES else f"more than {DISCARD_BYTES}")
    return b"".join(chunks)


def _top(entry: dict, token: int, k: int) -> dict:
    """The ``k`` most likely of a logprobs entry, and ``token``'s own."""
    best = dict(sorted(entry.items(), key=lambda kv: -kv[1])[:k])
    if token in entry:
        best[token] = entry[token]
    return best


def _sse(payload) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class OpenAIServing:
    """The request handlers, sharing the engine, the tokenizer and the model name."""

    def __init__(self, async_engine: AsyncLLMEngine, model_name: str, chat_template: str | None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None, enable_auto_tool_choice: bool = False):
        from jpaged.agents.reasoning_parsers import get_reasoning_parser
        from jpaged.agents.tool_parsers import get_tool_parser

        self.engine, self.model_name, self.chat_template = async_engine, model_name, chat_template
        self.tool_parser = get_tool_parser(tool_call_parser) if tool_call_parser else None
        self.reasoning_parser = get_reasoning_parser(reasoning_parser) if reasoning_parser else None
        if enable_auto_tool_choice and self.tool_parser is None:
            raise ValueError("enable_auto_tool_choice: needs a tool_call_parser")
        self.auto_tool_choice = enable_auto_tool_choice
        self.tokenizer = async_engine.tokenizer
        self.max_body_bytes = max_body_bytes
        self.draining = False  # set by `drain`: new requests get a 503
        self.adapters = ServedAdapters(getattr(getattr(async_engine, "engine", None), "lora", None), model_name)
        self._token_text: dict[int, str] = {}

    async def parse(self, raw: Request, model: type[pydantic.BaseModel]):
        """The request body as ``model``: bounded in size, parsed on a worker thread when large (so
        that a megabyte of JSON never stalls the event loop and the streams it serves)."""
        body = await read_body(raw, self.max_body_bytes)
        if len(body) <= INLINE_BODY_BYTES:
            return parse_body(body, model)
        try:
            return await asyncio.to_thread(parse_body, body, model)
        finally:
            del body
            release_free_host_memory()  # what a large body took goes back to the OS

    # Helpers --------------------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter that ``model`` names (None: the base model); 404 for an unknown name."""
        if model is None or model == self.model_name:
            return None
        adapter = self.adapters.by_name.get(model)
        if adapter is None:
            raise APIError(404, f"The model `{model}` does not exist (this server serves `{self.model_name}`"
                           f"{''.join(f', `{n}`' for n in self.adapters.by_name)}).", param="model",
                           code="model_not_found")
        return adapter

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)
            self._token_text[token_id] = text
        return text

    async def check_params(self, params, body) -> None:
        """The vocabulary checks of ``params`` (token ids, logprobs), once per HTTP request: an error
        is a 400 naming the field."""
        try:
            params.validate_for_vocab(self.engine.model_config.vocab_size, self.tokenizer)
        except ValueError as e:
            raise bad_request(e, structured_param=body.structured_param) from None

    async def start(self, request_id: str, prompts: list, params, delta: bool, prompt_param: str,
                    cache_salt: str | None = None, structured_param: str = "structured_outputs",
                    lora_request: LoRARequest | None = None) -> list:
        """Adds one engine request per prompt; all accepted, or none (then the APIError). Each is
        processed (tokenized, validated, its grammar compiled into the shared cache) on a worker
        thread, off the event loop and the engine loop."""
        self.check_accepting()
        requests = []
        for i, prompt in enumerate(prompts):
            try:
                requests.append(await asyncio.to_thread(self.engine.process, f"{request_id}-{i}", prompt, params,
                                                        cache_salt=cache_salt, lora_request=lora_request))
            except ValueError as e:
                raise bad_request(ValueError(f"prompt[{i}]: {e}" if len(prompts) > 1 else str(e)),
                                  prompt_param, structured_param) from None
        self.check_accepting()
        try:
            streams = self.engine.add_requests(requests, delta=delta)
        except QueueFullError as e:
            raise APIError(503, str(e), type="server_error", code="queue_full") from None
        except AdmissionError as e:  # could never be admitted: not worth a retry
            raise bad_request(e, prompt_param, structured_param) from None
        except RuntimeError as e:  # shutting down
            raise APIError(503, str(e), type="server_error") from None
        try:
            results = await asyncio.gather(*(asyncio.wrap_future(s.added) for s in streams), return_exceptions=True)
        except BaseException:
            self.abort(streams)
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self.abort(streams)
            e = errors[0]
            if isinstance(e, ValueError):
                raise bad_request(ValueError(f"prompt[{results.index(e)}]: {e}" if len(prompts) > 1 else str(e)),
                                  prompt_param, structured_param)
            raise e
        return streams

    def check_accepting(self) -> None:
        if self.draining or not self.engine.is_running:
            raise APIError(503, "the server is shutting down; retry on another replica", type="server_error",
                           code="shutting_down")
        if self.engine.engine.sleep_level:  # a training loop put it to sleep (POST /sleep)
            raise APIError(503, "the engine is asleep: POST /wake_up first", type="server_error", code="sleeping")

    def failure(self, choice, structured_param: str) -> APIError | None:
        """The error a failed choice (finish_reason "error") is: a 400 naming the constraint when its
        grammar failed (``stop_reason`` says why), else a 500."""
        if choice.finish_reason != "error":
            return None
        reason = choice.stop_reason if isinstance(choice.stop_reason, str) else ""
        if reason.startswith("structured_outputs"):
            return APIError(400, reason, param=structured_param)
        return APIError(500, "the engine failed while generating this request", type="server_error")

    def abort(self, streams) -> None:
        for s in streams:
            if not s.finished:
                self.engine.abort(s.request_id)

    async def merged(self, streams):
        """(prompt index, output) from all streams, as they come."""
        if len(streams) == 1:
            async for out in streams[0]:
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i, stream):
            try:
                async for out in stream:
                    await queue.put((i, out))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 -- re-raised by the reader
                await queue.put((i, e))
            finally:
                await queue.put((i, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(streams)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()

    async def collect(self, streams, raw: Request, structured_param: str) -> list:
        """Each stream's final output; a client that disconnects first aborts them all."""
        async def last(stream):
            out = None
            async for out in stream:
                pass
            return out

        work = asyncio.ensure_future(asyncio.gather(*(last(s) for s in streams)))
        watch = asyncio.ensure_future(_wait_for_disconnect(raw))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                self.abort(streams)
                work.cancel()
                await asyncio.wait({work})  # its outcome is retrieved: no "exception was never retrieved"
                if not work.cancelled():
                    work.exception()
                raise APIError(499, "client disconnected")
            outs = work.result()
        except (EngineError, RequestAbortedError) as e:
            raise APIError(500, str(e), type="server_error") from None
        finally:
            watch.cancel()
            self.abort(streams)
        for out in outs:
            for c in out.outputs:
                error = self.failure(c, structured_param)
                if error is not None:
                    raise error
        return outs

    def usage(self, prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def completion_logprobs(self, token_ids, logprobs, offset: int, top: int | None = None) -> dict:
        """OpenAI completions' logprobs: tokens, token_logprobs, top_logprobs, text_offset. An entry
        may be None (the first prompt token); ``top`` keeps the token and at most ``top`` others."""
        result = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, entry in zip(token_ids, logprobs or ()):
            text = self.token_text(t)
            if entry is not None and top is not None:
                entry = _top(entry, t, top)
            result["tokens"].append(text)
            result["token_logprobs"].append(None if entry is None else entry.get(t))
            result["top_logprobs"].append(None if entry is None else {self.token_text(k): v for k, v in entry.items()})
            result["text_offset"].append(offset)
            offset += len(text)
        return result

    def echo_logprobs(self, body: CompletionRequest, out) -> dict:
        """``echo`` with ``logprobs``: the prompt tokens' logprobs (the first one has none)."""
        entries = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
        return self.completion_logprobs(out.prompt_token_ids, entries, 0, top=body.logprobs)

    def prompt_logprobs(self, out, top: int) -> list | None:
        """vLLM's ``prompt_logprobs``: per prompt token None (the first) or {token id: {logprob,
        decoded_token}} for the token and the ``top`` most likely."""
        if out.prompt_logprobs is None:
            return None
        return [None if entry is None else
                {str(k): {"logprob": v, "decoded_token": self.token_text(k)} for k, v in _top(entry, t, top).items()}
                for t, entry in zip(out.prompt_token_ids, out.prompt_logprobs)]

    def chat_logprobs(self, token_ids, logprobs, top: int) -> dict:
        content = []
        for t, entry in zip(token_ids, logprobs or ()):
            best = sorted(entry.items(), key=lambda kv: -kv[1])[:top]
            content.append({"token": self.token_text(t), "logprob": entry.get(t),
                            "bytes": list(self.token_text(t).encode()),
                            "top_logprobs": [{"token": self.token_text(k), "logprob": v,
                                              "bytes": list(self.token_text(k).encode())} for k, v in best]})
        return {"content": content}

    async def error_events(self, gen):
        """Server-sent events from ``gen``; a failing engine or grammar ends the stream with an error
        event."""
        try:
            async for event in gen:
                yield event
        except (EngineError, RequestAbortedError) as e:
            yield _sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})
        except APIError as e:
            yield _sse({"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}})
        yield "data: [DONE]\n\n"

    # Completions -------------------------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, raw: Request):
        lora_request = self.check_model(body.model)
        try:
            params = body.sampling_params()
            prompts = body.prompts()
        except ValueError as e:
            raise bad_request(e, structured_param=body.structured_param) from None
        await self.check_params(params, body)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await self.start(request_id, prompts, params, body.stream, "prompt", body.cache_salt,
                                   body.structured_param, lora_request)
        created = int(time.time())
        base = {"id": request_id, "object": "text_completion", "created": created, "model": body.model or self.model_name}
        if body.stream:
            return StreamingResponse(self.error_events(self._completion_events(body, streams, base)),
                                     media_type="text/event-stream")
        outs = await self.collect(streams, raw, body.structured_param)
        choices, completion_tokens = [], 0
        for i, out in enumerate(outs):
            prompt_text = self._prompt_text(out) if body.echo else ""
            echoed = self.echo_logprobs(body, out) if body.echo and body.logprobs is not None else None
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                logprobs = None
                if body.logprobs is not None:
                    logprobs = self.completion_logprobs(c.token_ids, c.logprobs, len(prompt_text))
                    if echoed is not None:
                        logprobs = {k: echoed[k] + logprobs[k] for k in logprobs}
                choice = {"index": i * body.n + c.index, "text": prompt_text + c.text, "logprobs": logprobs,
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if body.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self.prompt_logprobs(out, body.prompt_logprobs)
                choices.append(choice)
        choices.sort(key=lambda ch: ch["index"])
        usage = self.usage(sum(len(o.prompt_token_ids) for o in outs), completion_tokens,
                           sum(o.num_cached_tokens for o in outs))
        return {**base, "choices": choices, "usage": usage}

    def _prompt_text(self, out) -> str:
        if out.prompt is not None:
            return out.prompt
        return self.tokenizer.decode(out.prompt_token_ids) if self.tokenizer is not None else ""

    async def _completion_events(self, body: CompletionRequest, streams, base: dict):
        """Chunks per step; the first chunk of each choice carries the echoed prompt (with its logprobs)
        or, when asked, vLLM's ``prompt_logprobs``."""
        prompt_tokens = completion_tokens = cached = 0
        offsets: dict[int, int] = {}
        seen, first = set(), {}  # prompts seen; prompt index -> what its choices' first chunks add
        try:
            async for i, out in self.merged(streams):
                if i not in seen:
                    seen.add(i)
                    prompt_tokens += len(out.prompt_token_ids)
                    cached += out.num_cached_tokens
                    extra = ({} if body.prompt_logprobs is None
                             else {"prompt_logprobs": self.prompt_logprobs(out, body.prompt_logprobs)})
                    if body.echo:
                        text = self._prompt_text(out)
                        echoed = self.echo_logprobs(body, out) if body.logprobs is not None else None
                        for j in range(body.n):
                            offsets[i * body.n + j] = len(text)
                        yield _sse({**base, "choices": [{"index": i * body.n + j, "text": text, "logprobs": echoed,
                                                         "finish_reason": None, **extra} for j in range(body.n)]})
                    else:
                        first[i] = (extra, set())
                for c in out.outputs:
                    error = self.failure(c, body.structured_param)
                    if error is not None:
                        raise error
                    index = i * body.n + c.index
                    completion_tokens += len(c.token_ids)
                    logprobs = None
                    if body.logprobs is not None:
                        logprobs = self.completion_logprobs(c.token_ids, c.logprobs, offsets.get(index, 0))
                        offsets[index] = offsets.get(index, 0) + sum(len(t) for t in logprobs["tokens"])
                    choice = {"index": index, "text": c.text, "logprobs": logprobs,
                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                    if i in first and c.index not in first[i][1]:
                        first[i][1].add(c.index)
                        choice.update(first[i][0])
                    yield _sse({**base, "choices": [choice]})
            if body.include_usage:
                yield _sse({**base, "choices": [], "usage": self.usage(prompt_tokens, completion_tokens, cached)})
        finally:
            self.abort(streams)

    # Chat -----------------------------------------------------------------------------------------------
    def _chat_inputs(self, body: ChatCompletionRequest):
        """(prompt, sampling params, tool request) of a chat request, grammars compiled; ValueError
        names the field. Runs on a worker thread."""
        tool_request = body.tool_request()
        if tool_request is not None and tool_request.choice == "auto" and not self.auto_tool_choice:
            raise ValueError('tool_choice="auto" (the default with tools): needs the server started with '
                             '--enable_auto_tool_choice --tool_call_parser; use "required", a named function or "none"')
        params = body.sampling_params()
        prompt = apply_chat_template(self.tokenizer, body.messages, self.chat_template, body.add_generation_prompt,
                                     self.engine.check_text_length,
                                     tools=tool_request.template_tools if tool_request else None)
        params = constrained_params(params, tool_request, self.reasoning_parser, self.tokenizer,
                                    self.engine.model_config.vocab_size)
        return prompt, params, tool_request

    def _chat_stream(self, tool_request) -> ChatOutputStream:
        return ChatOutputStream(self.reasoning_parser, self.tool_parser, tool_request)

    async def chat(self, body: ChatCompletionRequest, raw: Request):
        lora_request = self.check_model(body.model)
        try:
            prompt, params, tool_request = await asyncio.to_thread(self._chat_inputs, body)
        except ValueError as e:
            raise bad_request(e, "messages", body.structured_param) from None
        await self.check_params(params, body)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self.start(request_id, [prompt], params, body.stream, "messages", body.cache_salt,
                                   body.structured_param, lora_request)
        base = {"id": request_id, "object": "chat.completion", "created": int(time.time()),
                "model": body.model or self.model_name}
        if body.stream:
            return StreamingResponse(self.error_events(self._chat_events(body, streams[0], base, tool_request)),
                                     media_type="text/event-stream")
        out = (await self.collect(streams, raw, body.structured_param))[0]
        top = body.top_logprobs or 0
        choices = []
        for c in sorted(out.outputs, key=lambda c: c.index):
            message = parse_chat_output(c.text, c.finish_reason, self.reasoning_parser, self.tool_parser, tool_request)
            choices.append({"index": c.index, "message": message.to_openai(),
                            "logprobs": self.chat_logprobs(c.token_ids, c.logprobs, top) if body.logprobs else None,
                            "finish_reason": message.finish_reason, "stop_reason": c.stop_reason})
        usage = self.usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs),
                           out.num_cached_tokens)
        return {**base, "choices": choices, "usage": usage}

    async def _chat_events(self, body: ChatCompletionRequest, stream, base: dict, tool_request=None):
        """Chunks per step: ``content``, ``reasoning_content`` and ``tool_calls`` deltas (each call's
        ``index``, ``id`` and name, then its arguments in pieces) as they parse."""
        base = {**base, "object": "chat.completion.chunk"}
        top = body.top_logprobs or 0
        prompt_tokens = completion_tokens = cached = 0
        parsers = {j: self._chat_stream(tool_request) for j in range(body.n)}
        try:
            for j in range(body.n):
                yield _sse({**base, "choices": [{"index": j, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}]})
            async for out in stream:
                prompt_tokens, cached = len(out.prompt_token_ids), out.num_cached_tokens
                for c in out.outputs:
                    error = self.failure(c, body.structured_param)
                    if error is not None:
                        raise error
                    completion_tokens += len(c.token_ids)
                    parser = parsers[c.index]
                    delta, finish_reason = parser.feed(c.text), c.finish_reason
                    if c.finish_reason is not None:
                        last, _, finish_reason = parser.finish(c.finish_reason)
                        merge_delta(delta, last)
                    logprobs = self.chat_logprobs(c.token_ids, c.logprobs, top) if body.logprobs else None
                    yield _sse({**base, "choices": [{"index": c.index, "delta": delta, "logprobs": logprobs,
                                                     "finish_reason": finish_reason, "stop_reason": c.stop_reason}]})
            if body.include_usage:
                yield _sse({**base, "choices": [], "usage": self.usage(prompt_tokens, completion_tokens, cached)})
        finally:
            self.abort([stream])

    # Models -----------------------------------------------------------------------------------------------
    def models(self) -> dict:
        card = {"id": self.model_name, "object": "model", "created": int(time.time()), "owned_by": "jpaged",
                "root": self.model_name, "parent": None}
        max_model_len = getattr(self.engine, "max_model_len", None)
        if max_model_len is not None:
            card["max_model_len"] = max_model_len
        return {"object": "list", "data": [card] + self.adapters.cards()}


class APIKeyMiddleware:
    """401 for every ``/v1`` call (and training-loop route) without ``Authorization: Bearer <api_key>``
    (the scheme in any case, as HTTP has it; plain ASGI, so that streaming and disconnects pass through untouched)."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and (scope["path"].startswith("/v1") or scope["path"] in TRAINING_ROUTES):
            scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").strip().partition(b" ")
            if not (scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.expected)):
                response = error_response(401, "Incorrect or missing API key (send `Authorization: Bearer <key>`).",
                                          code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def is_json_content_type(value: str) -> bool:
    """``application/json`` or ``application/*+json``, in any case, with or without parameters
    (``; charset=utf-8``)."""
    media_type = value.partition(";")[0].strip().lower()
    return media_type == "application/json" or (media_type.startswith("application/")
                                                 and media_type.endswith("+json"))


class JSONContentTypeMiddleware:
    """415 for every POST whose ``Content-Type`` is not JSON (or is missing), before its body is read.

    A web page may send any site a POST with ``text/plain``, a form type or no body at all without
    a CORS preflight (a "simple request"); no such request can carry a JSON content type, so none
    reaches a route, whatever the page that sent it.
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            given = dict(scope["headers"]).get(b"content-type", b"").decode("latin-1").strip()
            if not is_json_content_type(given):
                sent = f"`Content-Type: {given}`" if given else "no Content-Type"
                response = error_response(415, f"Unsupported media type: the request has {sent}; "
                                               "send the JSON body with `Content-Type: application/json`",
                                          code="unsupported_media_type")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/?#\s]+", re.IGNORECASE)


def check_allowed_origins(origins) -> list[str]:
    """The origins as a list; a ValueError naming the one that is neither ``*`` nor an origin
    (``scheme://host[:port]``, no path)."""
    origins = [o.strip() for o in ([origins] if isinstance(origins, str) else origins)]
    for origin in origins:
        if origin != "*" and not ORIGIN.fullmatch(origin):
            raise ValueError(f"allowed_origins: {origin!r} is not an origin (scheme://host[:port], no path "
                             "or trailing slash) or '*'")
    return origins


async def _wait_for_disconnect(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


async def drain(app: FastAPI, timeout: float, poll: float = 0.05) -> int:
    """The graceful stop: from now on new requests get a 503 (and ``/health`` too); the requests in
    flight get ``timeout`` seconds to finish, then the rest are aborted, so that each ends with
    ``finish_reason="abort"`` (streams with a last chunk and ``data: [DONE]``). Returns how many
    were aborted. The app's shutdown then stops the engine."""
    serving: OpenAIServing = app.state.serving
    engine = serving.engine
    serving.draining = True
    deadline = time.monotonic() + timeout
    while engine.num_unfinished and time.monotonic() < deadline:
        await asyncio.sleep(poll)
    aborted = engine.abort_all()
    await asyncio.gather(*(asyncio.wrap_future(f) for f in aborted), return_exceptions=True)
    return len(aborted)


def create_app(async_engine: AsyncLLMEngine, *, served_model_name: str, api_key: str | None = None,
               chat_template: str | None = None, metrics: ServerMetrics | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, allowed_origins=(),
               enable_weight_updates: bool = False, tool_call_parser: str | None = None,
               reasoning_parser: str | None = None, enable_auto_tool_choice: bool = False,
               lora_modules=()) -> FastAPI:
    """The FastAPI app. Its shutdown (e.g. uvicorn's on SIGTERM) shuts the engine down; `drain`
    first lets the requests in flight finish.

    Pass ``metrics`` when it was built before the engine (so that its ``on_output`` is the engine's);
    otherwise the app makes one and hooks it in. ``allowed_origins`` (origins such as
    ``https://app.example``, or ``"*"``) are the web origins whose pages may call the API: their
    CORS preflights are answered and their responses carry ``Access-Control-Allow-Origin``; by
    default no page may. ``enable_weight_updates``: ``POST /update_weights``
    answers (else 403); the other training-loop routes are `training_routes`.
    ``tool_call_parser`` reads ``tool_choice="auto"``
    output (allowed only with ``enable_auto_tool_choice``); ``reasoning_parser`` splits off
    ``reasoning_content`` (`jpaged.agents`).
    """
    allowed_origins = check_allowed_origins(allowed_origins)
    if metrics is None:
        metrics = ServerMetrics(async_engine, served_model_name)
        async_engine.on_output = metrics.on_output
    serving = OpenAIServing(async_engine, served_model_name, chat_template, max_body_bytes, tool_call_parser,
                            reasoning_parser, enable_auto_tool_choice)
    for name, path in lora_modules:  # (name, path) pairs: --lora_modules; a bad one fails the start
        serving.adapters.load(name, path)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(async_engine.shutdown)

    app = FastAPI(title="jpaged", lifespan=lifespan)
    app.state.serving, app.state.metrics = serving, metrics

    app.add_middleware(JSONContentTypeMiddleware)
    if api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    if allowed_origins:  # outermost: a preflight carries no API key, and errors carry the CORS headers
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type"])

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return error_response(e.status, e.message, e.type, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def request_validation_error(request, e: RequestValidationError):
        first = (e.errors() or [{}])[0]
        if first.get("type") == "json_invalid":
            return error_response(400, f"Invalid JSON body: {first.get('msg', '')}")
        error = validation_error(e, prefix=1)  # loc[0] is "body"
        return error_response(error.status, error.message, param=error.param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail), code=None if e.status_code != 404 else "not_found")

    @app.exception_handler(Exception)
    async def internal_error(request, e: Exception):
        return error_response(500, f"internal error: {e}", type="server_error")

    @app.get("/health")
    async def health():
        if serving.draining:
            return error_response(503, "the server is shutting down (draining its requests)", type="server_error",
                                  code="shutting_down")
        if not async_engine.is_running:
            return error_response(503, "the engine is not running", type="server_error")
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        return serving.models()

    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await serving.completions(await serving.parse(raw, CompletionRequest), raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        return await serving.chat(await serving.parse(raw, ChatCompletionRequest), raw)

    add_lora_routes(app, serving, lambda status, message, param: APIError(status, message, param=param))

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(await metrics.render(), media_type=CONTENT_TYPE_LATEST)

    add_training_routes(app, serving, enable_weight_updates=enable_weight_updates)

    return app
