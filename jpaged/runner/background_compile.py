"""Executables compiled on a worker thread while the engine goes on without them.

A decode window (`decode_window`) traces the whole model in a loop: a compile of ~0.5-3 s per batch
shape, which must not stall a step. ``BackgroundCompiler.executable(key, fn, args)`` returns the
compiled ``fn`` for ``args``' shapes once it is ready, else None; the caller runs another way
meanwhile (the runner: one single step). A key's compile is queued once it has been asked for
``hot_after`` times (a shape that keeps coming back: the compile, which takes one of the cores for
a while, pays only over many steps), or at once with ``now``. Compiles run one at a time, so at
interpreter exit only the one in progress is waited for, and the rest of the queue is dropped.
"""
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import jax

logger = logging.getLogger("jpaged")


def _abstract(x):
    """A device array as its shape, dtype and sharding (it may be donated or replaced before the
    compile reads it); host values as they are."""
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return x


class BackgroundCompiler:
    def __init__(self, mesh, hot_after: int = 1):
        self.mesh, self.hot_after = mesh, hot_after
        self._asks: dict = {}  # key -> times asked for, until its compile is queued
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jpaged-compile")
        self._futures: dict = {}  # key -> Future of the executable
        self._queue: list = []    # (key, fn, abstract args) not submitted yet
        self._lock = threading.Lock()

    def executable(self, key, fn, args, *, now: bool = False):
        """The executable of jitted ``fn`` for ``args``' shapes (``key`` names them), or None until
        it is compiled (never, if its compile failed)."""
        with self._lock:
            future = self._futures.get(key)
            if future is None:
                self._asks[key] = asks = self._asks.get(key, 0) + 1
                if asks < self.hot_after and not now:
                    return None
                del self._asks[key]
                self._futures[key] = Future()
                self._queue.append((key, fn, jax.tree.map(_abstract, args)))
                self._submit_next()
                return None
        if not future.done() or future.exception() is not None:
            return None
        return future.result()

    def __contains__(self, key) -> bool:
        """Whether ``key``'s compile is queued, running or done."""
        return key in self._futures

    def wait(self) -> None:
        """Blocks until every queued compile has ended."""
        with self._lock:
            futures = list(self._futures.values())
        for future in futures:
            future.exception()  # waits; a failed compile was logged

    def _submit_next(self) -> None:
        """Starts the next queued compile unless one is running (called with the lock held)."""
        if not self._queue or any(f.running() for f in self._futures.values()):
            return
        key, fn, args = self._queue.pop(0)
        target = self._futures[key]
        target.set_running_or_notify_cancel()
        try:
            self._executor.submit(self._compile, target, fn, args)
        except RuntimeError:  # the interpreter is shutting down
            target.set_exception(RuntimeError("not compiled: the interpreter is shutting down"))

    def _compile(self, target: Future, fn, args) -> None:
        try:
            with jax.set_mesh(self.mesh):
                target.set_result(fn.lower(*args).compile())
        except Exception as error:  # noqa: BLE001 -- the caller keeps its other way
            logger.warning("background compile failed; going on without it: %r", error)
            target.set_exception(error)
        with self._lock:
            self._submit_next()
