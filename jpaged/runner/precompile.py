"""Warm-up: compile the step shapes before serving, so that none compiles while requests wait.

A step's shapes depend only on its token count, sampled rows and sampling options
(`buckets.StepBuckets`), so dummy steps of each token bucket, then the logits and sampler of each
row count (greedy and sampled, without penalties or filters), cover the steady state. Dummy steps
write into block 0, which is free: nothing reads it before its owner writes it.
"""
import logging
import time

from jpaged.core.scheduler_output import SampleRow, ScheduledSeq, SchedulerOutput
from jpaged.runner.model_runner import ModelRunner, plain_sampling
from jpaged.utils import cdiv

logger = logging.getLogger("jpaged")


def dummy_step(runner: ModelRunner, num_tokens: int, num_rows: int = 1, greedy: bool = True) -> SchedulerOutput:
    """A step of ``num_tokens`` tokens, all in block 0, sampling ``num_rows`` rows: ``num_rows - 1``
    one-token sequences, then the rest in as few sequences as ``max_model_len`` allows."""
    buckets = runner.buckets
    rest = num_tokens - (num_rows - 1)
    per_seq = min(rest, buckets.max_model_len)
    lengths = [1] * (num_rows - 1) + [per_seq] * (rest // per_seq) + ([rest % per_seq] if rest % per_seq else [])
    more = runner.kv_layout.num_groups - 1  # the tables of the other KV-cache groups: block 0 too
    seqs = [ScheduledSeq("warmup", 0, [0] * n, 0, [0] * cdiv(n, buckets.block_size),
                         [[0] * cdiv(n, buckets.block_size)] * more) for n in lengths]
    sampling = plain_sampling(num_rows)[0 if greedy else 1]
    return SchedulerOutput(seqs=seqs, sample_rows=[SampleRow(i, 0) for i in range(num_rows)], sampling=sampling)


def warm_up(runner: ModelRunner, *, max_tokens: int, max_seqs: int, precompile: bool,
            decode_windows: bool = False) -> None:
    """Compiles the smallest step; with ``precompile``, every step shape a step of at most
    ``max_tokens`` tokens and ``max_seqs`` sequences can have (and, with ``decode_windows``, the
    decode window of every decode batch)."""
    start = time.perf_counter()
    buckets = runner.buckets
    for t_pad in buckets.token_buckets(max_tokens if precompile else 1):
        if runner.pieces is not None or not precompile:
            runner.execute(dummy_step(runner, t_pad))
            continue
        for r_pad in buckets.row_buckets(t_pad):  # a whole step compiles per (tokens, rows, sampling)
            for greedy in (True, False):
                runner.execute(dummy_step(runner, t_pad, min(r_pad, max_seqs), greedy))
    if precompile:
        runner.compile_heads(max_tokens, max_seqs)
        if decode_windows:
            runner.compile_decode_windows(max_seqs)
        logger.info("precompiled %d step shapes in %.1f s", runner.num_compilations, time.perf_counter() - start)
