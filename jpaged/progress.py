"""Progress on the waits of start-up: a count with the time left (`CountProgress`, for precompiling
and ahead-of-time compiles) and a phase that says what it is doing once it runs long (`phase`).

Both write to stderr and stay silent for waits shorter than ``delay`` (5 s): a fast start prints
nothing more than it did. On a terminal a count is a tqdm bar; otherwise (logs, CI) it is plain
lines ``jpaged: <label> k/N, ~T s left``, at most one per ``interval`` seconds.
"""
import contextlib
import sys
import threading
import time

from tqdm.auto import tqdm

from jpaged.logger import logger

DELAY_S = 5.0     # waits shorter than this print nothing
INTERVAL_S = 5.0  # plain lines: at most one per this many seconds


def eta_seconds(done: int, total: int, elapsed: float) -> float:
    """Seconds left if the rest goes at the pace so far."""
    return elapsed / done * (total - done) if done else float("nan")


class CountProgress:
    """``total`` units of work, ``update()`` after each: a tqdm bar on a terminal, else plain
    ``<label> k/N, ~T s left`` lines, bounded in rate; nothing for the first ``delay`` seconds."""

    def __init__(self, label: str, total: int, *, stream=None, delay: float | None = None,
                 interval: float | None = None, clock=time.perf_counter):
        self.label, self.total, self.done = label, total, 0
        self.stream = stream if stream is not None else sys.stderr
        self.delay = DELAY_S if delay is None else delay
        self.interval = INTERVAL_S if interval is None else interval
        self.clock = clock
        self.start = self.last_line = clock()
        self.lines = 0
        isatty = getattr(self.stream, "isatty", None)
        self.bar = (tqdm(total=total, desc=f"jpaged: {label}", file=self.stream, delay=self.delay, leave=False)
                    if isatty is not None and isatty() else None)

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = self.clock()
        if now - self.start < self.delay or now - self.last_line < self.interval:
            return
        self.last_line, self.lines = now, self.lines + 1
        left = eta_seconds(self.done, self.total, now - self.start)
        print(f"jpaged: {self.label} {self.done}/{self.total}, ~{left:.0f} s left", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@contextlib.contextmanager
def phase(what: str, *, delay: float | None = None):
    """Logs ``<what> ...`` once the block has run ``delay`` seconds, and ``<what> took T s`` after a
    block that ran that long: a slow start says what it waits on, a fast one says nothing."""
    delay = DELAY_S if delay is None else delay
    start = time.perf_counter()
    timer = threading.Timer(delay, logger.info, args=("%s ...", what))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        seconds = time.perf_counter() - start
        if seconds >= delay:
            logger.info("%s took %.1f s", what, seconds)
