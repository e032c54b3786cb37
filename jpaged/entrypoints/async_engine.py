"""AsyncLLMEngine: the engine loop on its own thread, requests from any thread or coroutine.

Only the loop thread touches the LLMEngine. Between steps it runs the calls queued by other threads
(add, abort, metrics), then steps while there is work and hands each request's outputs to its
`RequestStream`. A stream is read with ``async for`` (or a plain ``for`` from a thread); it yields
the request's newest cumulative `RequestOutput`, or with ``delta=True`` only what is new since the
previous one (each advanced completion's new text, token ids and logprobs; text that might still
turn out to be the start of a stop string is held back until it cannot). A reader that leaves early
aborts its request, which frees its blocks on the loop's next turn.

Admission follows vLLM's semantics: ``max_num_seqs`` sequences run, and beyond them up to
``max_queued_requests`` requests wait (`num_queued`); past that `add_request` raises `QueueFullError`
(retry later) at once. Requests that could never be admitted together, even on an idle engine,
raise `AdmissionError`, a ValueError (a 400, not a retryable 503).
"""
import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import threading
import time
import uuid

from jpaged.core.request import Request
from jpaged.logger import logger
from jpaged.outputs import RequestOutput


class QueueFullError(RuntimeError):
    """More requests are waiting than ``max_queued_requests`` allows."""


class AdmissionError(ValueError):
    """A request larger than ``max_num_seqs`` running plus ``max_queued_requests`` waiting."""


class EngineError(RuntimeError):
    """An engine step failed; the requests in flight were aborted."""


class RequestAbortedError(RuntimeError):
    """The request was aborted before the engine produced an output for it."""


def _num_seqs(prompt, params) -> int:
    """The sequences a request runs at once: its beam width, or ``n``."""
    if isinstance(prompt, Request):
        return prompt.beam.params.beam_width if prompt.beam is not None else prompt.sampling_params.n
    width = getattr(params, "beam_width", None)
    return width if isinstance(width, int) else max(getattr(params, "n", 1), 1)


class RequestStream:
    """The outputs of one request, filled by the engine thread, read by one consumer."""

    def __init__(self, request_id: str, stop, abort, delta: bool):
        self.request_id = request_id
        self.finished = False
        self.added: concurrent.futures.Future | None = None  # resolves when the engine accepted it
        self._abort, self._delta = abort, delta
        self._holdback = max((len(s) for s in stop or ()), default=1) - 1
        self._sent: dict[int, tuple[int, int, int]] = {}  # index -> chars, tokens, logprobs sent
        self._done: set[int] = set()                      # indices whose finish was sent
        self._lock = threading.Lock()
        self._items: list = []
        self._ready = threading.Event()
        try:
            self._loop, self._event = asyncio.get_running_loop(), asyncio.Event()
        except RuntimeError:
            self._loop = self._event = None

    def put(self, item) -> None:
        """A RequestOutput or an exception (engine thread)."""
        with self._lock:
            self._items.append(item)
        self._ready.set()
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._event.set)
            except RuntimeError:  # the consumer's loop is closed
                pass

    def _next(self) -> RequestOutput | None:
        with self._lock:
            items, self._items = self._items, []
        for item in items:
            if isinstance(item, BaseException):
                self.finished = True
                raise item
        if not items:
            return None
        out = items[-1]  # outputs are cumulative: the newest says everything
        self.finished = out.finished
        return self._delta_of(out) if self._delta else out

    def _delta_of(self, out: RequestOutput) -> RequestOutput | None:
        changed = []
        for c in out.outputs:
            chars, tokens, lps = self._sent.get(c.index, (0, 0, 0))
            done = c.finish_reason is not None
            visible = len(c.text) if done else max(chars, len(c.text) - self._holdback)
            text, token_ids = c.text[chars:visible], c.token_ids[tokens:]
            if not (text or token_ids or (done and c.index not in self._done)):
                continue
            logprobs = None if c.logprobs is None else c.logprobs[lps:]
            self._sent[c.index] = (max(chars, visible), len(c.token_ids), len(c.logprobs or ()))
            if done:
                self._done.add(c.index)
            changed.append(dataclasses.replace(c, text=text, token_ids=token_ids, logprobs=logprobs))
        if not changed and not out.finished:
            return None
        return dataclasses.replace(out, outputs=changed)

    async def __aiter__(self):
        if self._loop is None:
            raise RuntimeError("RequestStream: created outside an event loop; iterate it with `for`")
        try:
            while not self.finished:
                await self._event.wait()
                self._event.clear()
                out = self._next()
                if out is not None:
                    yield out
        finally:
            if not self.finished:
                self._abort(self.request_id)

    def __iter__(self):
        try:
            while not self.finished:
                self._ready.wait()
                self._ready.clear()
                out = self._next()
                if out is not None:
                    yield out
        finally:
            if not self.finished:
                self._abort(self.request_id)


class AsyncLLMEngine:
    """Serves an `LLMEngine` from a background thread.

    ``on_output(output, num_new_tokens, now)`` (optional) is called on the loop thread for every
    output, aborted ones included: the server's Prometheus metrics hang there. An engine with an
    ``on_idle()`` method has it called on the loop thread each time the loop is about to wait for
    work (`jpaged.serve.mirrored_engine.LeaderEngine` sends its followers the calls queued since
    its last step).
    """

    def __init__(self, engine, *, max_queued_requests: int | None = None, on_output=None):
        if max_queued_requests is not None and max_queued_requests < 0:
            raise ValueError(f"max_queued_requests={max_queued_requests}: must be >= 0 or None")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_queued_requests = max_queued_requests
        self.on_output = on_output
        self._lock = threading.Lock()
        self._calls: collections.deque = collections.deque()
        self._streams: dict[str, RequestStream] = {}
        self._admitted: set[str] = set()  # requests the scheduler has taken (seen in a step's outputs)
        self._slots: dict[str, int] = {}  # request id -> the sequences it runs (n, or beam_width)
        self.max_num_seqs = engine.max_num_seqs
        self._num_tokens: dict[str, int] = {}
        self._wakeup = threading.Event()
        self._on_idle = getattr(engine, "on_idle", None)  # before each wait for work (a multi-host leader's)
        self._stopping = self._closed = False
        self._thread = threading.Thread(target=self._run, name="jpaged-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_args(cls, model: str | None = None, *, max_queued_requests: int | None = None, **engine_kwargs):
        """Builds the engine with ``LLM(model, **engine_kwargs)``'s settings."""
        from jpaged.engine import create_engine
        from jpaged.config_resolution import engine_config

        return cls(create_engine(engine_config(model, **engine_kwargs)), max_queued_requests=max_queued_requests)

    @property
    def model_config(self):
        return self.engine.model_config

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def check_text_length(self, text: str, field: str = "prompt") -> None:
        """ValueError when ``text`` is too long to be a prompt (the input processor's bound)."""
        self.engine.input_processor.check_text_length(text, field)

    def process(self, request_id, prompt, params=None, *, cache_salt: str | None = None,
                lora_request=None) -> Request:
        """The validated request (ValueError for a bad one), from any thread: the engine's input
        processing, off the loop thread. ``lora_request``: the `LoRARequest` it runs with."""
        request_id = uuid.uuid4().hex if request_id is None else str(request_id)
        return self.engine.process(request_id, prompt, params, cache_salt=cache_salt, lora_request=lora_request)

    # State -------------------------------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    # These are the front's own counts, read at once from any thread under its lock (the bound on
    # `max_queued_requests` uses them): a request counts as running from its first output on, so a
    # preempted one still counts as running. The scheduler's exact queue lengths are
    # ``get_metrics()["num_running_requests"]`` / ``["num_waiting_requests"]`` (read on the loop
    # thread; the /metrics gauges use them).
    @property
    def num_running(self) -> int:
        """Requests that have had an output and not finished."""
        with self._lock:
            return len(self._admitted)

    @property
    def num_waiting(self) -> int:
        """Requests added (or being added) that have had no output yet."""
        with self._lock:
            return len(self._streams) - len(self._admitted)

    @property
    def num_queued(self) -> int:
        """Requests that wait because the running sequences fill ``max_num_seqs`` (what
        ``max_queued_requests`` bounds)."""
        with self._lock:
            return self._queued(self._free_slots(), [self._slots[r] for r in self._streams if r not in self._admitted])

    def _free_slots(self) -> int:
        return self.max_num_seqs - sum(self._slots.get(r, 0) for r in self._admitted)

    @staticmethod
    def _queued(free: int, slots: list[int]) -> int:
        """How many of the not-yet-running requests (their sequence counts, in arrival order) wait
        with ``free`` sequence slots: the first that does not fit and every one after it."""
        for i, k in enumerate(slots):
            if k > free:
                return len(slots) - i
            free -= k
        return 0

    def _check_admission(self, slots: list[int]) -> None:
        """Raises unless requests of these sequence counts can be added now (the lock held)."""
        limit = self.max_queued_requests
        if limit is None:
            return
        if self._queued(self.max_num_seqs, slots) > limit:
            raise AdmissionError(f"prompt: {len(slots)} requests of {sum(slots)} sequences can never be admitted "
                                 f"together: max_num_seqs={self.max_num_seqs} sequences run and "
                                 f"max_queued_requests={limit} requests wait")
        pending = [self._slots[r] for r in self._streams if r not in self._admitted]
        queued = self._queued(self._free_slots(), pending + slots)
        if queued > limit:
            raise QueueFullError(f"the queue is full: max_num_seqs={self.max_num_seqs} sequences run and "
                                 f"max_queued_requests={limit} requests wait; retry later")

    # Requests ------------------------------------------------------------------------------------------
    def add_request(self, request_id, prompt=None, params=None, *, cache_salt: str | None = None,
                    delta: bool = False) -> RequestStream:
        """Queues a request from any thread (a `Request` from `process`, or an id with its prompt
        and parameters, then processed on the loop thread); returns its stream at once.
        ``stream.added`` (a concurrent future) raises the engine's ValueError if it is rejected."""
        if isinstance(request_id, Request):
            return self.add_requests([request_id], delta=delta)[0]
        return self._register([(request_id, prompt, params, cache_salt)], delta)[0]

    def add_requests(self, requests: list[Request], *, delta: bool = False) -> list[RequestStream]:
        """Queues processed requests together: all are admitted, or none (`QueueFullError`,
        `AdmissionError`)."""
        return self._register([(r.request_id, r, r.sampling_params, None) for r in requests], delta)

    def _register(self, entries: list[tuple], delta: bool) -> list[RequestStream]:
        ids = [uuid.uuid4().hex if rid is None else str(rid) for rid, _, _, _ in entries]
        slots = [_num_seqs(prompt, params) for _, prompt, params, _ in entries]
        streams = [RequestStream(rid, getattr(params, "stop", None), self.abort, delta)
                   for rid, (_, _, params, _) in zip(ids, entries)]
        with self._lock:
            if self._stopping:
                raise RuntimeError("the engine is shutting down")
            taken = [rid for rid in ids if rid in self._streams]
            if taken or len(set(ids)) < len(ids):
                raise ValueError(f"request_id={(taken or ids)[0]!r}: already in use")
            self._check_admission(slots)
            for rid, stream, k in zip(ids, streams, slots):
                self._streams[rid], self._slots[rid] = stream, k
        for rid, stream, (_, prompt, params, cache_salt) in zip(ids, streams, entries):
            stream.added = self.call(functools.partial(self._add, rid, prompt, params, cache_salt))
        return streams

    async def add(self, request_id, prompt, params=None, *, cache_salt: str | None = None,
                  delta: bool = False) -> RequestStream:
        """`add_request`, awaiting the engine's acceptance (ValueError for a bad request)."""
        stream = self.add_request(request_id, prompt, params, cache_salt=cache_salt, delta=delta)
        try:
            await asyncio.wrap_future(stream.added)
        except BaseException:
            self.abort(stream.request_id)
            raise
        return stream

    async def generate(self, prompt, params=None, request_id=None, *, cache_salt: str | None = None,
                       delta: bool = False):
        """Async iterator over one request's outputs (cumulative, or deltas)."""
        stream = await self.add(request_id, prompt, params, cache_salt=cache_salt, delta=delta)
        async for out in stream:
            yield out

    @property
    def num_unfinished(self) -> int:
        """Requests added and not finished."""
        with self._lock:
            return len(self._streams)

    def abort_all(self) -> list[concurrent.futures.Future]:
        """Aborts every unfinished request (a drain's end); each stream gets its final output."""
        with self._lock:
            ids = list(self._streams)
        return [self.abort(request_id) for request_id in ids]

    def abort(self, request_id) -> concurrent.futures.Future:
        """Aborts a request from any thread; its blocks are freed before the next step."""
        return self.call(lambda: self._abort(str(request_id)))

    async def get_metrics(self) -> dict:
        """The engine's `get_metrics()`, read on the loop thread between steps."""
        return await asyncio.wrap_future(self.call(self.engine.get_metrics))

    # Training loops: pause, new weights, sleep (each runs on the loop thread between steps) ----------
    @property
    def is_paused(self) -> bool:
        return self.engine.paused

    async def pause_generation(self, *, abort: bool = False) -> None:
        """Stops stepping after the current step: requests in flight (and new ones) wait until
        `resume_generation`, or with ``abort=True`` the unfinished ones end now with
        ``finish_reason="abort"``."""
        def pause():
            self.engine.paused = True
            if abort:
                for request_id in list(self._streams):
                    self._abort(request_id)
        await asyncio.wrap_future(self.call(pause))

    async def resume_generation(self) -> None:
        await asyncio.wrap_future(self.call(lambda: setattr(self.engine, "paused", False)))

    async def update_weights(self, weights, draft_weights=None) -> None:
        """`LLMEngine.update_weights` (refused with requests in flight unless paused)."""
        await asyncio.wrap_future(self.call(functools.partial(self.engine.update_weights, weights,
                                                              draft_weights=draft_weights)))

    async def sleep(self, level: int = 1) -> None:
        await asyncio.wrap_future(self.call(functools.partial(self.engine.sleep, level)))

    async def wake_up(self) -> None:
        await asyncio.wrap_future(self.call(self.engine.wake_up))

    def call(self, fn) -> concurrent.futures.Future:
        """Runs ``fn()`` on the loop thread between steps; its result or exception in the future."""
        future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                future.set_exception(RuntimeError("the engine is shut down"))
                return future
            self._calls.append((fn, future))
        self._wakeup.set()
        return future

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Aborts every request and stops the loop thread."""
        with self._lock:
            self._stopping = True
        self._wakeup.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # The loop thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            self._run_calls()
            if self._stopping:
                break
            if self.engine.paused or not self.engine.has_unfinished_requests():
                if self._on_idle is not None:
                    try:
                        self._on_idle()
                    except Exception:  # noqa: BLE001 -- the next step reports it to its requests
                        logger.exception("on_idle failed")
                self._wakeup.wait()
                self._wakeup.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # noqa: BLE001 -- fail the requests in flight, keep serving
                logger.exception("engine step failed")
                self._fail_all(e)
                continue
            if not outputs:
                time.sleep(0.0005)  # nothing could be scheduled this step
            self._dispatch(outputs)
        for request_id in list(self._streams):
            self._abort(request_id)
        with self._lock:
            self._closed = True
        self._run_calls()

    def _run_calls(self) -> None:
        while True:
            with self._lock:
                if not self._calls:
                    return
                fn, future = self._calls.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001 -- handed to the caller
                future.set_exception(e)

    def _add(self, request_id, prompt, params, cache_salt) -> None:
        with self._lock:
            if request_id not in self._streams:  # aborted before it was added
                raise RequestAbortedError(f"request {request_id} was aborted")
        try:
            if isinstance(prompt, Request):
                self.engine.add_request(prompt)
            else:
                self.engine.add_request(request_id, prompt, params, cache_salt=cache_salt)
        except BaseException:
            with self._lock:
                self._forget(request_id)
            raise

    def _forget(self, request_id: str) -> RequestStream | None:
        """Drops a request from the front's books (the lock held); returns its stream."""
        self._admitted.discard(request_id)
        self._slots.pop(request_id, None)
        return self._streams.pop(request_id, None)

    def _abort(self, request_id: str) -> None:
        out = self.engine.abort_request(request_id)
        with self._lock:
            stream = self._forget(request_id)
        self._num_tokens.pop(request_id, None)
        if out is not None and self.on_output is not None:
            self._notify(out, 0)
        if stream is not None:
            stream.put(out if out is not None else RequestAbortedError(f"request {request_id} was aborted"))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            rid = out.request_id
            with self._lock:
                stream = self._streams.get(rid)
                if out.finished:
                    self._forget(rid)
                elif stream is not None:
                    self._admitted.add(rid)
            num_tokens = sum(len(c.token_ids) for c in out.outputs)
            new = num_tokens - self._num_tokens.get(rid, 0)
            if out.finished:
                self._num_tokens.pop(rid, None)
            else:
                self._num_tokens[rid] = num_tokens
            if self.on_output is not None:
                self._notify(out, max(new, 0))
            if stream is not None:
                stream.put(out)

    def _notify(self, out: RequestOutput, new: int) -> None:
        try:
            self.on_output(out, new, time.time())
        except Exception:  # noqa: BLE001 -- metrics must never stop the loop
            logger.exception("on_output failed")

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            ids = list(self._streams)
        for request_id in ids:
            try:
                self.engine.abort_request(request_id)
            except Exception:  # noqa: BLE001
                logger.exception("abort after a failed step")
            with self._lock:
                stream = self._forget(request_id)
            self._num_tokens.pop(request_id, None)
            if stream is not None:
                stream.put(EngineError(f"engine step failed: {error}"))
