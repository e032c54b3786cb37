"""``prompt_logprobs=k``: the log-probability of each prompt token given the tokens before it, and
the top ``k`` alternatives, computed in the jitted step from the same hidden states as the KV cache.

Each prefill chunk covers positions ``[start, start + n)``; position ``p`` predicts prompt token
``p + 1``, so a chunk contributes the prompt tokens ``start + 1 .. min(start + n, P - 1)`` (the
last prompt position predicts the first output token, which is sampled as usual). Chunked prefill
therefore reports every prompt token once; a recomputed prompt (preemption) writes the same values
again. Requests asking for prompt logprobs do not read the prefix cache (a cached block's tokens are
never run through the model), so they always report the whole prompt.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.utils import bucket, padded_ids


@functools.partial(jax.tree_util.register_dataclass, data_fields=["indices", "targets"],
                   meta_fields=["num_logprobs"])
@dataclasses.dataclass
class PromptLogprobTensors:
    indices: jax.Array   # int32 [Tp]: rows of the step's hidden states (padded with 0)
    targets: jax.Array   # int32 [Tp]: the prompt token each row predicts
    num_logprobs: int = 0  # top alternatives per row (static)


def compute(logits, t: PromptLogprobTensors):
    """logits [Tp, V] -> (target logprobs [Tp], top ids [Tp, k], top logprobs [Tp, k])."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    target = jnp.take_along_axis(logprobs, t.targets[:, None], axis=-1)[:, 0]
    k = min(t.num_logprobs, logits.shape[-1])
    if k:
        top_lps, top_ids = jax.lax.top_k(logprobs, k)
    else:
        top_lps, top_ids = jnp.zeros((logits.shape[0], 0)), jnp.zeros((logits.shape[0], 0), jnp.int32)
    return target, top_ids.astype(jnp.int32), top_lps


def wanted(request, seq, start: int, n: int) -> list[int]:
    """Positions of this chunk whose logits give prompt logprobs (empty when not asked for)."""
    k = getattr(request.sampling_params, "prompt_logprobs", None)
    if k is None or request.beam is not None:
        return []
    return list(range(start, min(start + n, seq.num_prompt_tokens - 1)))


def build(rows: list[tuple], indices: list[int], targets: list[int]) -> PromptLogprobTensors | None:
    """``rows``: (request, position) per index. None when no row of the step asks."""
    if not rows:
        return None
    k = max(r.sampling_params.prompt_logprobs for r, _ in rows)
    return PromptLogprobTensors(padded_ids(indices, fill=0), padded_ids(targets, fill=0), bucket(k, 0))


def record(rows: list[tuple], targets: list[int], results) -> None:
    """Writes each row's entry into ``request.prompt_logprobs`` (``None`` for the first token)."""
    target_lps, top_ids, top_lps = (np.asarray(a) for a in results)
    for i, ((request, pos), tok) in enumerate(zip(rows, targets)):
        if request.prompt_logprobs is None:
            request.prompt_logprobs = [None] * len(request.prompt_token_ids)
        k = request.sampling_params.prompt_logprobs
        entry = {int(tok): float(target_lps[i])}
        entry.update({int(t): float(lp) for t, lp in zip(top_ids[i, :k], top_lps[i, :k]) if int(t) not in entry})
        request.prompt_logprobs[pos + 1] = entry
