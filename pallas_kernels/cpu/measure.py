"""Whether a C++ kernel is faster than the XLA path it replaces, measured on this machine.

The first time a kernel could serve a shape class (`dispatch.runs`, while a model is traced), the
kernel and the XLA path are timed on that class in one XLA program, their operations one after the
other with `jpaged_probe` calls between them (probe.cc: each records the time and evicts the
weights or KV pages from the caches, as a model's step finds them), and the faster is kept: the C++
kernel only where it takes at most `MARGIN` of XLA's time. Shape classes:

- matmul: the weight shapes of one call (``K`` and every ``N``) and a row class, the rows up to one
  of `MATMUL_ROWS`, measured at that bound (the most rows, where XLA's GEMM does best). The classes
  above one row are measured together (XLA's dot is a library call there: its program compiles in
  milliseconds); one row (XLA emits its own matrix-vector code) alone, when first needed.
- matmul_t (the weight stored ``[N, K]``): the same, against XLA's ``x @ w.T``.
- greedy: the vocabulary and a row class of `GREEDY_ROWS`, each when first needed.
- paged attention: the heads, head size and block size, on one step of decode rows and a prompt
  (compiling XLA's path for it takes seconds: the price of a first use).

A measurement can be disturbed by other work on the machine. One taken while the machine was busy
(`busy`: the load average above the usable cores), whose repeats disagree (`disturbed`: a path's
slowest run more than `SPREAD` above its fastest) without a clear margin (every run of one path
beating every run of the other by `MARGIN`), or out of line with the row classes measured beside it
(`out_of_line`: a path slower than at more rows, or a choice unlike both its neighbours' where
they agree: other work can slow all the repeats of one class alike) is **provisional**: it serves
this process, and the
next process to need it measures again. A quiet measurement replaces a provisional one; a
disturbed one is merged with it (each path's least time: other work only adds time), and after
`MAX_MEASUREMENTS` disturbed ones the merged times decide for good.

The choices are kept in a JSON file beside the library (`library.choices_path`: keyed as the
library is, by sources, flags, jaxlib and CPU; inside it by the usable cores and ``XLA_FLAGS``),
so each is measured once per machine (a provisional one until it is decided), and logged (one line
per measurement, or per cached group first used in a process). ``JPAGED_CPU_KERNELS``
(`library.forced`) overrides them.
"""
import json
import logging
import os
import tempfile
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu import library, ops

MATMUL_ROWS = (1, 8, 32, 64, 128, 256)  # matmul row classes: rows up to each bound
GREEDY_ROWS = (16, 256)  # greedy row classes (more rows: the last)
MARGIN = 0.95  # the C++ kernel serves where it takes at most this fraction of XLA's time
TIMED_RUNS = 3  # runs of a measurement program after its warm-up (fewer past BUDGET_SECONDS, never under 2)
BUDGET_SECONDS = 0.25
SPREAD = 0.15  # repeats disagree where a path's slowest run takes more than 1 + SPREAD of its fastest
BUSY_LOAD = 1.0  # the machine is busy where the 1-minute load average exceeds this many per usable core
MAX_MEASUREMENTS = 3  # disturbed measurements merged before their times decide for good

logger = logging.getLogger("jpaged")
_lock = threading.RLock()
_choices: dict = {}  # this context's entries: key -> {"cpp": bool, "cpp_ms": float, "xla_ms": float}
_loaded: list = []  # the file's path, once read
_logged: set = set()
_measured: set = set()  # the keys this process measured (a provisional one is measured again by the next)


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def context() -> str:
    """What else the choices depend on: the cores this process may use and ``XLA_FLAGS``."""
    return f"cores={usable_cores()} XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}"


def load_average() -> float:
    """The machine's 1-minute load average (0 where the system does not say)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def busy() -> str:
    """Why the machine is too busy for a measurement to be final ("" when it is not)."""
    load, cores = load_average(), usable_cores()
    return f"load {load:.1f} on {cores} cores" if load > BUSY_LOAD * cores else ""


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _entries() -> dict:
    if not _loaded:
        _loaded.append(library.choices_path())
        _choices.update(_read(_loaded[0]).get(context(), {}))
    return _choices


def _save(new: dict) -> None:
    """Adds ``new`` to the file (merged with what other processes wrote meanwhile), atomically."""
    path = _loaded[0]
    everything = _read(path)
    everything.setdefault(context(), {}).update(new)
    fd, tmp = tempfile.mkstemp(suffix=".json", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(everything, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as error:  # a read-only cache: the choices hold for this process only
        logger.info("could not keep the C++ kernel choices in %s (%s)", path, error)
        if os.path.exists(tmp):
            os.remove(tmp)


def row_class(rows: int, bounds: tuple) -> int:
    return next((b for b in bounds if rows <= b), bounds[-1])


def _decide(group: str, batch: list, key: str, measure) -> bool:
    """The choice for ``key``, one of the keys ``batch`` of ``group`` that ``measure()`` times
    together (it returns ``{key: (C++ run times, XLA run times)}``, seconds), measuring them where
    ``key`` is new, or provisional and not yet measured by this process."""
    with _lock:
        entries = _entries()
        if key not in entries or (entries[key].get("provisional") and key not in _measured):
            start, busy_before = time.perf_counter(), busy()
            try:
                new = measure()
            except Exception as error:  # noqa: BLE001 - a failed measurement keeps XLA's path (this process)
                logger.warning("measuring the C++ CPU kernel for %s failed (%s): XLA's path serves", group, error)
                entries.update({k: {"cpp": False, "cpp_ms": None, "xla_ms": None} for k in batch})
                return False
            why_busy, suspects = busy_before or busy(), out_of_line(new)
            kept = {k: merged(entries.get(k), runs, why_busy or suspects.get(k, "")) for k, runs in new.items()}
            entries.update(kept)
            _measured.update(kept)
            _save(kept)
            _log(group, batch, f"measured in {time.perf_counter() - start:.2f} s, kept in")
        elif (group, key) not in _logged:
            _log(group, [k for k in entries if k == group or k.startswith(group + " ")], "cached in")
        return entries[key]["cpp"]


def _cpp_wins(cpp_s: float, xla_s: float) -> bool:
    return cpp_s <= MARGIN * xla_s


def _entry(cpp_s: float, xla_s: float) -> dict:
    return {"cpp": _cpp_wins(cpp_s, xla_s), "cpp_ms": cpp_s * 1e3, "xla_ms": xla_s * 1e3}


def out_of_line(batch: dict) -> dict:
    """Why classes measured together cannot decide for good, seen by comparing them: ``batch`` maps
    each key, in order of rows, to its (C++ run times, XLA run times). More rows cannot take less
    time, so a path slower (by more than `SPREAD`) than at a class of more rows was delayed; and a
    choice unlike both its neighbours' where they agree is checked again. Returns ``{key: why}``."""
    keys = list(batch)
    least = [(min(cpp_runs), min(xla_runs)) for cpp_runs, xla_runs in batch.values()]
    cpp = [_cpp_wins(c, x) for c, x in least]
    why = {}
    for i, key in enumerate(keys):
        for path, name in enumerate(("C++", "XLA")):
            more = next((j for j in range(i + 1, len(keys)) if least[i][path] > (1 + SPREAD) * least[j][path]), None)
            if more is not None:
                why[key] = f"{name} slower than at {keys[more].rsplit(' ', 1)[-1]}"
        if 0 < i < len(keys) - 1 and cpp[i - 1] == cpp[i + 1] != cpp[i] and key not in why:
            why[key] = f"{'C++' if cpp[i] else 'XLA'} chosen between classes that chose {'XLA' if cpp[i] else 'C++'}"
    return why


def disturbed(cpp_runs: list, xla_runs: list, why_suspect: str = "") -> str:
    """Why one measurement (each path's run times) cannot decide for good ("" when it can): a reason
    seen outside its repeats (``why_suspect``: a busy machine, `out_of_line`), or repeats that
    disagree where the margin is not clear either way."""
    if why_suspect:
        return why_suspect
    spread = max(max(runs) / min(runs) - 1 for runs in (cpp_runs, xla_runs))
    clear = max(cpp_runs) <= MARGIN * min(xla_runs) or min(cpp_runs) > MARGIN * max(xla_runs)
    return f"repeats {spread:.0%} apart" if spread > SPREAD and not clear else ""


def merged(old: dict | None, runs: tuple, why_suspect: str = "") -> dict:
    """The entry kept after a measurement (``runs``: the C++ kernel's and XLA's run times, seconds)
    of a class whose entry was ``old`` (None: new). A final entry stays unless the new one is final
    too; a provisional one is replaced by a final one, or merged with another disturbed one (the
    least time of each path), which decides for good at the `MAX_MEASUREMENTS`-th."""
    cpp_runs, xla_runs = runs
    why = disturbed(cpp_runs, xla_runs, why_suspect)
    new = _entry(min(cpp_runs), min(xla_runs))
    if not why:
        return new
    if old is not None and old.get("cpp_ms") is not None and not old.get("provisional"):
        return old
    count = 1
    if old is not None and old.get("provisional"):
        count = old.get("measurements", 1) + 1
        new = _entry(min(old["cpp_ms"], new["cpp_ms"]) / 1e3, min(old["xla_ms"], new["xla_ms"]) / 1e3)
    if count >= MAX_MEASUREMENTS:
        return new | {"measurements": count}
    return new | {"provisional": True, "measurements": count, "why": why}


def _log(group: str, keys: list, source: str) -> None:
    parts = []
    for k in keys:
        _logged.add((group, k))
        e = _choices[k]
        times = "" if e["cpp_ms"] is None else f" ({e['cpp_ms']:.3f} vs {e['xla_ms']:.3f} ms)"
        if e.get("provisional"):
            times += f" provisional ({e['why']}; measured again at the next start)"
        elif e.get("measurements"):
            times += f" decided after {e['measurements']} disturbed measurements"
        parts.append(f"{k[len(group):].strip() or 'all'}: {'C++' if e['cpp'] else 'XLA'}{times}")
    logger.info("kernel choice for %s: %s [C++ vs XLA time; %s %s]", group, ", ".join(parts), source,
                _loaded[0])


# ------------------------------------------------------------------------------------------
def _probe(x, after, evict, slot: int):
    call = jax.ffi.ffi_call("jpaged_probe", jax.ShapeDtypeStruct(x.shape, x.dtype), has_side_effect=True)
    return call(x, *after, *evict, slot=np.int64(slot), evict_from=np.int64(len(after)))


def time_steps(steps, args, evict=()) -> list[float]:
    """Seconds each of ``steps`` takes, the least of `time_runs`."""
    return [min(runs) for runs in time_runs(steps, args, evict)]


def time_runs(steps, args, evict=()) -> list[list[float]]:
    """Seconds each of ``steps`` takes in each timed run: ``(fn, i)`` calls ``fn(*args)`` with
    ``args[i]`` taken from the probe before it (so it waits for the step before), the buffers
    ``args[j]`` for ``j`` in ``evict`` evicted from the caches first. One XLA program for all, which
    runs the first step once more before them (the first operation of a run waits for the thread
    pool to wake); it runs once to warm up, then `TIMED_RUNS` times (at least 2: the repeats that
    tell a disturbed measurement, past `BUDGET_SECONDS`)."""
    smallest = min(range(len(args)), key=lambda i: args[i].size)

    def program(*args):
        after = ()
        for slot, (fn, i) in enumerate([steps[0], *steps]):
            inputs = list(args)
            inputs[i] = _probe(args[i], after, [args[j] for j in evict], slot)
            after = tuple(jax.tree.leaves(fn(*inputs)))
        return _probe(args[smallest], after, [], len(steps) + 1)

    with jax.ensure_compile_time_eval():
        args = [jax.device_put(a) for a in args]
        compiled = jax.jit(program).lower(*args).compile()
        runs = [[] for _ in steps]
        start = time.perf_counter()
        for run in range(TIMED_RUNS + 1):
            jax.block_until_ready(compiled(*args))
            if run:  # the first run warms up (first-touch pages, thread pools)
                for s, times in enumerate(runs):
                    times.append(library.probe_seconds(s + 1))
                if run >= 2 and time.perf_counter() - start > BUDGET_SECONDS:
                    break
    return runs


def filled(shape, scale=0.01):
    """A cheap array of small non-zero values (the timings do not depend on them)."""
    return np.full(shape, scale, np.float32) + np.arange(shape[-1], dtype=np.float32) * (scale / shape[-1])


# ------------------------------------------------------------------------------------------
def matmul(k: int, widths: tuple, rows: int, packed: bool = False) -> bool:
    """Whether the C++ matmul serves ``x [rows, k] @ w_i [k, widths[i]]`` (one call); ``packed``:
    from the weights' packed copies (`ops.matmuls_packed`)."""
    group = f"matmul{' packed' if packed else ''} [{k}] x [{'+'.join(map(str, widths))}]"
    bounds = MATMUL_ROWS[:1] if rows <= MATMUL_ROWS[0] else MATMUL_ROWS[1:]
    batch = [f"{group} rows<={b}" for b in bounds]
    return _decide(group, batch, f"{group} rows<={row_class(rows, MATMUL_ROWS)}",
                   lambda: _measure_matmul(k, widths, bounds, batch, packed=packed))


def matmul_t(k: int, n: int, rows: int, packed: bool = False) -> bool:
    """Whether the C++ matmul serves ``x [rows, k] @ w.T`` with ``w [n, k]``; ``packed``: from a
    packed copy of ``w.T`` (`ops.matmuls_packed`), else from ``w`` as it lies (`ops.matmul_t`)."""
    group = f"matmul_t{' packed' if packed else ''} [{k}] x [{n}, {k}]^T"
    bounds = MATMUL_ROWS[:1] if rows <= MATMUL_ROWS[0] else MATMUL_ROWS[1:]
    batch = [f"{group} rows<={b}" for b in bounds]
    return _decide(group, batch, f"{group} rows<={row_class(rows, MATMUL_ROWS)}",
                   lambda: _measure_matmul(k, (n,), bounds, batch, transposed=True, packed=packed))


def _measure_matmul(k, widths, bounds, keys, transposed=False, packed=False):
    args = [filled((n, k) if transposed else (k, n)) for n in widths]
    weights = list(range(len(widths)))
    copies = [len(args) + j for j in weights] if packed else weights  # what the C++ kernel reads
    args += [filled((n // ops.PACKED_PANEL, k, ops.PACKED_PANEL)) for n in widths] if packed else []
    args += [filled((b, k), 0.1) for b in bounds]
    steps = []
    for i in range(len(bounds)):
        x = len(args) - len(bounds) + i
        if transposed and not packed:
            steps.append((lambda *a, x=x: ops.matmul_t(a[x], a[0]), x))
        else:
            kernel = ops.matmuls_packed if packed else ops.matmuls
            steps.append((lambda *a, x=x, kernel=kernel: kernel(a[x], [a[j] for j in copies]), x))
        steps.append((lambda *a, x=x: [a[x] @ (a[j].T if transposed else a[j]) for j in weights], x))
    runs = time_runs(steps, args, evict=sorted(set(weights) | set(copies)))
    return {key: (runs[2 * i], runs[2 * i + 1]) for i, key in enumerate(keys)}


def _argmax(x):
    """The first maximum's index per row, as the sampler's XLA path computes it (two reductions)."""
    vocab = x.shape[-1]
    best = jnp.max(x, axis=-1, keepdims=True)
    return jnp.minimum(jnp.min(jnp.where(x == best, jnp.arange(vocab, dtype=jnp.int32), vocab), axis=-1), vocab - 1)


def greedy(vocab: int, rows: int) -> bool:
    """Whether the C++ greedy reductions serve logits ``[rows, vocab]``."""
    group = f"greedy [{vocab}]"
    bound = row_class(rows, GREEDY_ROWS)
    key = f"{group} rows<={bound}"
    return _decide(group, [key], key, lambda: _measure_greedy(vocab, bound, key))


def _measure_greedy(vocab, rows, key):
    steps = [(lambda x: ops.greedy(x), 0), (lambda x: (_argmax(x), jax.nn.logsumexp(x, axis=-1)), 0)]
    return {key: tuple(time_runs(steps, [filled((rows, vocab), 1.0)]))}


# A step of the attention measurement: (query tokens, context) per sequence, a prompt among decode rows.
ATTENTION_STEP = [(48, 48)] + [(1, 64 + 29 * i) for i in range(15)]


def paged_attention(num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> bool:
    """Whether the C++ paged attention serves float32 pages of these sizes."""
    group = f"paged_attention heads {num_q_heads}/{num_kv_heads} x {head_dim}, blocks of {block_size}"
    return _decide(group, [group], group, lambda: _measure_attention(num_q_heads, num_kv_heads, head_dim, block_size, group))


def _measure_attention(hq, hkv, d, bs, key):
    from pallas_kernels.jnp.attention import ragged_paged_attention_reference

    blocks = [-(-ctx // bs) for _, ctx in ATTENTION_STEP]
    tables = np.zeros((len(blocks), max(blocks)), np.int32)
    first = 0
    for s, n in enumerate(blocks):
        tables[s, :n] = np.arange(first, first + n)
        first += n
    rng = np.random.default_rng(0)
    pages = [rng.standard_normal((hkv, first, bs, d), np.float32) for _ in range(2)]
    q = rng.standard_normal((sum(n for n, _ in ATTENTION_STEP), hq, d), np.float32)
    qsl = np.concatenate([[0], np.cumsum([n for n, _ in ATTENTION_STEP])]).astype(np.int32)
    lens = np.array([ctx for _, ctx in ATTENTION_STEP], np.int32)
    args = [q, *pages, tables, lens, qsl, np.array(len(ATTENTION_STEP), np.int32)]
    scale = d ** -0.5
    steps = [(lambda *a: ops.paged_attention(*a, scale=scale), 0),
             (lambda *a: ragged_paged_attention_reference(*a, scale=scale), 0)]
    return {key: tuple(time_runs(steps, args, evict=(1, 2)))}
