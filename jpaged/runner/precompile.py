"""Warm-up: compile the step shapes before serving, so that none compiles while requests wait.

A step's shapes depend only on its token count, sampled rows and sampling options
(`buckets.StepBuckets`), so a plan of dummy steps covers the steady state (`step_plan`): on the CPU
(layer pieces) one step per token bucket, then the logits and sampler of each row count; a whole-step
runner (TPU/GPU) compiles each token bucket with each of its row buckets, greedy and sampled, and on
the pallas backend the decode-only step of each decode bucket too (it runs the decode kernel). The
same plan is what `jpaged.entrypoints.aot` compiles for a target without one. With speculative decoding
a step samples up to ``max_num_seqs * (1 + num_speculative_tokens)`` rows
(`StepBuckets.max_num_rows`): the row buckets past ``max_num_seqs`` are verification steps, and a
draft model's calls compile with the steps they follow. With prefix-cache tiers, the pool's block
gather and scatter compile for every padded count their moves use (`KVPool.compile_transfers`). Dummy steps write into block 0, which is
free: nothing reads it before its owner writes it.
"""
import time

from jpaged.core.scheduler_output import SampleRow, ScheduledSeq, SchedulerOutput
from jpaged.logger import logger
from jpaged.progress import CountProgress
from jpaged.runner.buckets import StepBuckets
from jpaged.runner.model_runner import ModelRunner, plain_sampling
from jpaged.utils import cdiv


def dummy_step(buckets: StepBuckets, num_tokens: int, num_rows: int = 1, greedy: bool = True,
               decode_only: bool = False) -> SchedulerOutput:
    """A step of ``num_tokens`` tokens, all in block 0, sampling ``num_rows`` rows: ``num_rows - 1``
    one-token sequences, then the rest in as few sequences as ``max_model_len`` allows
    (``decode_only``: ``num_tokens`` one-token sequences, each sampled). More rows than
    ``max_num_seqs`` (speculative decoding) are verification rows: ``max_num_seqs`` sequences of
    one token and up to ``num_speculative_tokens`` proposals."""
    if num_rows > buckets.max_num_seqs:
        return _dummy_verification(buckets, num_tokens, num_rows, greedy)
    if decode_only:
        lengths = [1] * num_tokens
        num_rows = num_tokens
    else:
        rest = num_tokens - (num_rows - 1)
        per_seq = min(rest, buckets.max_model_len)
        lengths = [1] * (num_rows - 1) + [per_seq] * (rest // per_seq) + ([rest % per_seq] if rest % per_seq else [])
    seqs = []
    for n in lengths:
        table, group_tables = _tables(buckets, n)
        seqs.append(ScheduledSeq("warmup", 0, [0] * n, 0, table, group_block_tables=group_tables))
    sampling = plain_sampling(num_rows)[0 if greedy else 1]
    return SchedulerOutput(seqs=seqs, sample_rows=[SampleRow(i, 0) for i in range(num_rows)], sampling=sampling)


def _tables(buckets: StepBuckets, num_tokens: int) -> tuple[list[int], list[list[int]]]:
    """A dummy sequence's block table and those of the other KV-cache groups: block 0 throughout."""
    table = [0] * cdiv(num_tokens, buckets.block_size)
    return table, [table] * (buckets.num_kv_groups - 1)


def _dummy_verification(buckets, num_tokens: int, num_rows: int, greedy: bool) -> SchedulerOutput:
    """``num_rows`` sample rows over ``max_num_seqs`` sequences with proposals (tokens beyond the
    rows lead the first sequence)."""
    num_seqs = buckets.max_num_seqs
    per_seq = [num_rows // num_seqs + (i < num_rows % num_seqs) for i in range(num_seqs)]
    seqs, rows = [], []
    for i, r in enumerate(per_seq):
        n = r + (num_tokens - num_rows if i == 0 else 0)
        table, group_tables = _tables(buckets, n)
        seqs.append(ScheduledSeq("warmup", 0, [0] * (n - r + 1), 0, table, spec_token_ids=[0] * (r - 1),
                                 group_block_tables=group_tables))
        rows += [SampleRow(i, 0, j) for j in range(r)]
    return SchedulerOutput(seqs=seqs, sample_rows=rows, sampling=plain_sampling(num_rows)[0 if greedy else 1])


def step_plan(buckets: StepBuckets, *, max_tokens: int, max_seqs: int, whole_step: bool,
              precompile: bool = True) -> list[SchedulerOutput]:
    """The dummy steps that compile a runner's step shapes (without ``precompile``: the smallest)."""
    plan = []
    for t_pad in buckets.token_buckets(max_tokens if precompile else 1):
        if not (whole_step and precompile):
            plan.append(dummy_step(buckets, t_pad))
            continue
        for r_pad in buckets.row_buckets(t_pad):
            plan += [dummy_step(buckets, t_pad, min(r_pad, buckets.max_num_rows), greedy) for greedy in (True, False)]
        if buckets.attention_backend == "pallas" and t_pad <= buckets.max_seqs_bucket:
            plan += [dummy_step(buckets, min(t_pad, max_seqs), greedy=greedy, decode_only=True)
                     for greedy in (True, False)]
    return _distinct(plan)


def _distinct(plan: list[SchedulerOutput]) -> list[SchedulerOutput]:
    """The plan without repeats: a step of as many rows as tokens is already decode-only, the same
    step as the explicit decode-only one of its bucket (the engine would find it compiled; an
    ahead-of-time compile would compile it twice)."""
    seen, distinct = set(), []
    for step in plan:
        key = (tuple((len(s.token_ids), len(s.block_table), len(s.spec_token_ids or ())) for s in step.seqs),
               tuple((r.seq_row, r.sample_index, r.spec_index) for r in step.sample_rows), step.sampling.all_greedy)
        if key not in seen:
            seen.add(key)
            distinct.append(step)
    return distinct


def warm_up(runner: ModelRunner, *, max_tokens: int, max_seqs: int, precompile: bool,
            decode_windows: bool = False) -> None:
    """Compiles the smallest step; with ``precompile``, every step shape a step of at most
    ``max_tokens`` tokens and ``max_seqs`` sequences can have (and, with ``decode_windows``, the
    decode window of every decode batch)."""
    start = time.perf_counter()
    plan = step_plan(runner.buckets, max_tokens=max_tokens, max_seqs=max_seqs, whole_step=runner.pieces is None,
                     precompile=precompile)
    # the heads (CPU layer pieces) and the decode windows count as one unit each
    # and the prefix-cache tiers' block moves count as one unit each
    extra = (int(precompile and runner.pieces is not None) + int(precompile and decode_windows)
             + int(precompile and runner.kv_offload is not None))
    progress = CountProgress("precompile: step shapes", len(plan) + extra)
    try:
        for i, step in enumerate(plan):
            runner.execute(step)
            progress.update()
            if i == 0 and precompile and decode_windows:  # the first step has measured the CPU kernels
                runner.compile_decode_windows(max_seqs)  # on a second thread, beside the step shapes
        if precompile:
            if runner.pieces is not None:
                runner.compile_heads(max_tokens, min(max_tokens, runner.buckets.max_num_rows))
                progress.update()
            if decode_windows:
                runner.window_compiler.wait()
                progress.update()
            if runner.kv_offload is not None:
                for pool in runner.kv_pools:
                    pool.compile_transfers()
                progress.update()
    finally:
        progress.close()
    if precompile:
        logger.info("precompiled %d step shapes in %.1f s", runner.num_compilations, time.perf_counter() - start)
