"""One engine in every process of a mesh that spans hosts, driven by process 0.

JAX's multi-controller model: each host's process holds the same `LLMEngine` over the global mesh,
and a step is one program over every device, so every process must run the same scheduler on the
same calls in the same order (the sampled tokens come back the same to all of them, and from then
on their schedulers agree by themselves). Process 0, the leader, takes the requests; the others,
the followers, do what it did:

- `LeaderEngine` wraps the leader's engine and is what `AsyncLLMEngine` steps. The calls that
  change what the scheduler holds, ``add_request`` and ``abort_request``, run at once and are
  queued; ``step`` sends the queue with the step itself as one message (`call_channel`), then
  steps. ``on_idle`` (the async loop calls it before it sleeps) sends what is queued, so an idle
  follower holds what the leader holds. A request is sent as the arguments of ``process`` (prompt,
  parameters, cache salt, adapter), not as the `Request` built from them: each follower builds
  its own, the same way.
- `follow` is a follower's loop: each call of each message, in order, until the leader's stop.

Every other engine method reads state or runs on the leader only; the ones that would change the
devices (``update_weights``, ``sleep``, ``wake_up``) are refused (a `RuntimeError`, a 409 on the
training routes) rather than run on one host. Messages are pickles of ``(method, args, kwargs)``,
read back by an unpickler that builds nothing but jpaged's parameter dataclasses.
"""
import io
import pickle
import threading
import weakref

from jpaged.core.request import Request
from jpaged.logger import logger

STOP = "stop"
FOLLOWED = ("add_request", "abort_request", "step")  # the calls a follower runs
ALLOWED_CLASSES = {  # what a message may hold besides plain Python values
    ("jpaged.sampling_params", "SamplingParams"), ("jpaged.sampling_params", "BeamSearchParams"),
    ("jpaged.sampling_params", "StructuredOutputsParams"), ("jpaged.lora.request", "LoRARequest"),
}


class _CallUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) not in ALLOWED_CLASSES:
            raise pickle.UnpicklingError(f"an engine call may not hold {module}.{name}")
        return super().find_class(module, name)


def encode_call(method: str, *args, **kwargs) -> bytes:
    return pickle.dumps((method, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)


def decode_calls(message: bytes) -> list[tuple[str, tuple, dict]]:
    """A message's calls, each ``(method, args, kwargs)``."""
    return [_CallUnpickler(io.BytesIO(call)).load() for call in _CallUnpickler(io.BytesIO(message)).load()]


class LeaderEngine:
    """Process 0's engine: runs every call itself and sends the followers theirs (module docstring).

    Reads (``scheduler``, ``kv_cache``, ``get_metrics()``, ...) go to the wrapped engine.
    """

    def __init__(self, engine, channel):
        self._engine, self._channel = engine, channel
        self._queued: list[bytes] = []  # encoded calls not sent yet (the loop thread's)
        self._add_calls = weakref.WeakKeyDictionary()  # Request -> its encoded add_request (from `process`)
        self._lock = threading.Lock()  # `process` runs on worker threads
        self.closed = False

    def __getattr__(self, name):
        return getattr(self._engine, name)

    @property
    def paused(self) -> bool:
        return self._engine.paused

    @paused.setter
    def paused(self, value: bool) -> None:
        self._engine.paused = value

    def process(self, request_id, prompt, sampling_params=None, *, cache_salt=None, lora_request=None) -> Request:
        request = self._engine.process(request_id, prompt, sampling_params, cache_salt=cache_salt,
                                       lora_request=lora_request)
        call = encode_call("add_request", request.request_id, prompt, sampling_params, cache_salt=cache_salt,
                           lora_request=lora_request)
        with self._lock:
            self._add_calls[request] = call
        return request

    def add_request(self, request_id, prompt=None, sampling_params=None, *, cache_salt=None,
                    lora_request=None) -> Request:
        if isinstance(request_id, Request):
            with self._lock:
                call = self._add_calls.pop(request_id, None)
            if call is None:
                raise ValueError(f"request {request_id.request_id}: an engine spanning hosts adds only requests "
                                 "built by its own process() (the followers build theirs from the same arguments)")
        else:
            call = encode_call("add_request", str(request_id), prompt, sampling_params, cache_salt=cache_salt,
                               lora_request=lora_request)
        request = self._engine.add_request(request_id, prompt, sampling_params, cache_salt=cache_salt,
                                           lora_request=lora_request)
        self._queued.append(call)  # only once the leader took it: a refused request is refused everywhere
        return request

    def abort_request(self, request_id):
        known = str(request_id) in self._engine.requests
        out = self._engine.abort_request(request_id)
        if known:
            self._queued.append(encode_call("abort_request", str(request_id)))
        return out

    def step(self):
        self._send(encode_call("step"))
        return self._engine.step()

    def on_idle(self) -> None:
        """Sends the queued calls (the async loop is about to wait for work)."""
        if self._queued:
            self._send()

    def close(self) -> None:
        """Ends the followers' loops (after what is queued); idempotent."""
        if not self.closed:
            self._send(encode_call(STOP))
            self.closed = True

    def _send(self, *calls: bytes) -> None:
        if self.closed:
            raise RuntimeError("the engine spanning hosts is closed: its followers have stopped")
        message = pickle.dumps(self._queued + list(calls), protocol=pickle.HIGHEST_PROTOCOL)
        self._queued = []
        self._channel.send(message)

    def _refuse(self, what: str):
        raise RuntimeError(f"{what}: not on an engine spanning hosts (every host would have to run it at once); "
                           "restart the replica instead")

    def update_weights(self, weights, draft_weights=None) -> None:
        self._refuse("update_weights")

    def sleep(self, level: int = 1) -> None:
        self._refuse("sleep")

    def wake_up(self) -> None:
        self._refuse("wake_up")


def follow(engine, channel, stop: threading.Event, poll_s: float = 1.0) -> int:
    """Runs the leader's calls on ``engine`` in order until the leader's stop or ``stop`` is set;
    returns how many steps it ran. A call that raises is logged and the loop goes on: the leader's
    same call raised the same way (`AsyncLLMEngine` then aborts its requests, which come here too)."""
    steps = 0
    while not stop.is_set():
        message = channel.receive(poll_s)
        if message is None:
            continue
        for method, args, kwargs in decode_calls(message):
            if method == STOP:
                return steps
            if method not in FOLLOWED:
                raise ValueError(f"an engine call {method!r}: a follower runs only {', '.join(FOLLOWED)}")
            try:
                getattr(engine, method)(*args, **kwargs)
            except Exception:  # noqa: BLE001
                logger.exception("follower: %s failed", method)
            steps += method == "step"
    return steps
