"""The step shapes a batch of requests will need, before its first step (pure: integers only).

`step_shapes` replays the scheduler's token budget on the requests' lengths: each step gives the
running requests their tokens first (a decode token, or the next chunk of a prompt), oldest first,
then admits waiting requests in order while the budget and ``max_num_seqs`` allow; a prompt's last
chunk and every decode token sample a row; a request ends after its output length. It assumes no
preemption, no prefix-cache hit, one sequence per request and no early stop: what it gets wrong
only compiles on first use, as without a plan. ``ModelRunner.compile_ahead`` compiles the shapes.
"""
from collections import deque

from jpaged.runner.buckets import MIN_TOKENS, StepBuckets
from jpaged.utils import step_bucket

MAX_STEPS = 100_000  # a bound on the replay, far past any batch's steps


def batch_steps(prompt_lens: list[int], output_lens: list[int], *, max_num_batched_tokens: int,
                max_num_seqs: int) -> list[tuple[int, int]]:
    """(tokens, sampled rows) of each step the scheduler would run for these requests, queued at once."""
    waiting = deque(zip(prompt_lens, output_lens))
    running: list[list[int]] = []  # [prompt tokens computed, prompt length, tokens generated, output length]
    steps = []
    while (waiting or running) and len(steps) < MAX_STEPS:
        budget, tokens, rows = max_num_batched_tokens, 0, 0
        for request in running:
            if budget <= 0:
                break
            n, sampled = _advance(request, budget)
            budget, tokens, rows = budget - n, tokens + n, rows + sampled
        while waiting and budget > 0 and len(running) < max_num_seqs:
            prompt_len, output_len = waiting.popleft()
            request = [0, prompt_len, 0, output_len]
            running.append(request)
            n, sampled = _advance(request, budget)
            budget, tokens, rows = budget - n, tokens + n, rows + sampled
        steps.append((tokens, rows))
        running = [r for r in running if r[2] < r[3]]
    return steps


def _advance(request: list[int], budget: int) -> tuple[int, int]:
    """Schedules ``request``'s next tokens within ``budget``: (tokens, rows sampled)."""
    computed, prompt_len = request[0], request[1]
    if computed < prompt_len:  # a chunk of the prompt
        n = min(prompt_len - computed, budget)
        request[0] += n
        sampled = int(request[0] == prompt_len)
    else:  # a decode token
        n, sampled = 1, 1
    request[2] += sampled
    return n, sampled


def step_shapes(prompt_lens: list[int], output_lens: list[int], buckets: StepBuckets, *,
                max_num_batched_tokens: int) -> list[tuple[int, int]]:
    """The padded (tokens, sampled rows) of the batch's steps, each once, in the order first met."""
    shapes = {}
    for tokens, rows in batch_steps(prompt_lens, output_lens, max_num_batched_tokens=max_num_batched_tokens,
                                    max_num_seqs=buckets.max_num_seqs):
        t_pad = step_bucket(tokens, MIN_TOKENS)
        shapes.setdefault((t_pad, min(buckets.rows(rows, t_pad), buckets.max_num_rows)), None)
    return list(shapes)
