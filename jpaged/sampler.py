"""Jitted sampling over a batch of logits rows, each row with its own parameters.

Greedy, temperature, top-k, top-p, min-p, presence/frequency/repetition penalties, banned tokens
(EOS before ``min_tokens``), and a per-row random stream: row keys are
``fold_in(PRNGKey(seed), step)``, so a seeded request samples the same tokens whatever else is in
the batch. Returned log-probabilities are those of the model (log-softmax of the raw logits).
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["temperature", "top_k", "top_p", "min_p", "seeds", "steps",
                                "presence_penalty", "frequency_penalty", "repetition_penalty",
                                "output_token_ids", "prompt_token_ids", "banned_token_ids"],
                   meta_fields=["num_logprobs", "use_filters", "use_penalties", "all_greedy"])
@dataclasses.dataclass
class SamplingTensors:
    """Per-row sampling parameters [S]; token-id arrays are padded with -1."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    seeds: jax.Array              # uint32 [S]
    steps: jax.Array              # int32 [S]: tokens this sequence has generated so far
    presence_penalty: jax.Array
    frequency_penalty: jax.Array
    repetition_penalty: jax.Array
    output_token_ids: jax.Array   # [S, Lo] (Lo = 0 without penalties)
    prompt_token_ids: jax.Array   # [S, Lp]
    banned_token_ids: jax.Array   # [S, Lb]
    num_logprobs: int = 0         # top logprobs to return per row (static)
    use_filters: bool = False     # any top-k / top-p / min-p (static)
    use_penalties: bool = False   # any penalty (static)
    all_greedy: bool = True       # no row samples: skip the random numbers (static)


def _token_counts(token_ids, vocab_size):
    """[S, L] ids (-1 = none) -> [S, V] counts."""
    rows = jnp.arange(token_ids.shape[0])[:, None]
    ids = jnp.where(token_ids < 0, vocab_size, token_ids)
    counts = jnp.zeros((token_ids.shape[0], vocab_size), jnp.int32)
    return counts.at[rows, ids].add(1, mode="drop")


def apply_penalties(logits, t: SamplingTensors):
    vocab = logits.shape[-1]
    out_counts = _token_counts(t.output_token_ids, vocab)
    seen = (out_counts + _token_counts(t.prompt_token_ids, vocab)) > 0
    rp = t.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    logits = logits - t.frequency_penalty[:, None] * out_counts
    return logits - t.presence_penalty[:, None] * (out_counts > 0)


def apply_filters(logits, t: SamplingTensors):
    """Top-k, then top-p, then min-p, on temperature-scaled logits (masked entries -> -inf)."""
    vocab = logits.shape[-1]
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
    k = jnp.where(t.top_k > 0, jnp.minimum(t.top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)
    logits = jnp.where(logits < kth, -jnp.inf, logits)
    sorted_logits = jnp.where(jnp.arange(vocab)[None] < k[:, None], sorted_logits, -jnp.inf)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = mass_before < t.top_p[:, None]
    cutoff = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    max_prob_logit = sorted_logits[:, :1]
    min_logit = max_prob_logit + jnp.log(jnp.maximum(t.min_p[:, None], 1e-30))
    return jnp.where((t.min_p[:, None] > 0) & (logits < min_logit), -jnp.inf, logits)


def sample(logits, t: SamplingTensors):
    """logits [S, V] float32 -> (tokens [S], logprobs [S], top_ids [S, K], top_logprobs [S, K])."""
    logprobs_all = jax.nn.log_softmax(logits, axis=-1)
    if t.use_penalties:
        logits = apply_penalties(logits, t)
    if t.banned_token_ids.shape[1]:
        rows = jnp.arange(logits.shape[0])[:, None]
        ids = jnp.where(t.banned_token_ids < 0, logits.shape[-1], t.banned_token_ids)
        logits = logits.at[rows, ids].set(-jnp.inf, mode="drop")
    greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if t.all_greedy:
        return _with_logprobs(greedy_tokens, logprobs_all, t.num_logprobs)
    scaled = logits / jnp.where(t.temperature > 0, t.temperature, 1.0)[:, None]
    if t.use_filters:
        scaled = apply_filters(scaled, t)
    keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(t.seeds, t.steps)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (logits.shape[-1],), jnp.float32))(keys)
    sampled = jnp.argmax(scaled + gumbel, axis=-1)
    tokens = jnp.where(t.temperature > 0, sampled, greedy_tokens).astype(jnp.int32)
    return _with_logprobs(tokens, logprobs_all, t.num_logprobs)


def _with_logprobs(tokens, logprobs_all, num_logprobs):
    token_logprobs = jnp.take_along_axis(logprobs_all, tokens[:, None], axis=-1)[:, 0]
    if num_logprobs:
        top_logprobs, top_ids = jax.lax.top_k(logprobs_all, num_logprobs)
    else:
        top_logprobs = jnp.zeros((tokens.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((tokens.shape[0], 0), jnp.int32)
    return tokens, token_logprobs, top_ids.astype(jnp.int32), top_logprobs
