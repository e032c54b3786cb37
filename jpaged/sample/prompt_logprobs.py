"""``prompt_logprobs=k``: the log-probability of each prompt token given the tokens before it, and
the top ``k`` alternatives, computed in the jitted step from the same hidden states as the KV cache
(`jpaged.sample.sampler.prompt_logprobs`). This module is the host side: which positions of a step
ask, and recording the results on the request.

Each prefill chunk covers positions ``[start, start + n)``; position ``p`` predicts prompt token
``p + 1``, so a chunk contributes the prompt tokens ``start + 1 .. min(start + n, P - 1)`` (the
last prompt position predicts the first output token, which is sampled as usual). Chunked prefill
therefore reports every prompt token once; a recomputed prompt (preemption) writes the same values
again. Requests asking for prompt logprobs do not read the prefix cache (a cached block's tokens are
never run through the model), so they always report the whole prompt.
"""
import numpy as np


def wanted(request, seq, start: int, n: int) -> list[int]:
    """Positions of this chunk whose logits give prompt logprobs (empty when not asked for)."""
    if request.sampling_params.prompt_logprobs is None or request.beam is not None:
        return []
    return list(range(start, min(start + n, seq.num_prompt_tokens - 1)))


def record(rows: list[tuple], targets: list[int], results) -> None:
    """Writes each row's entry into ``request.prompt_logprobs`` (``None`` for the first token);
    ``rows``: (request, position, alternatives wanted) per row."""
    target_lps, top_ids, top_lps = (np.asarray(a) for a in results)
    for i, ((request, pos, k), tok) in enumerate(zip(rows, targets)):
        if request.prompt_logprobs is None:
            request.prompt_logprobs = [None] * len(request.prompt_token_ids)
        entry = {int(tok): float(target_lps[i])}
        entry.update({int(t): float(lp) for t, lp in zip(top_ids[i, :k], top_lps[i, :k]) if int(t) not in entry})
        request.prompt_logprobs[pos + 1] = entry
