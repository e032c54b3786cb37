"""Jitted sampling over a batch of logits rows, each row with its own parameters.

The order, for each row (docs/sampling.md):

1. ``logit_bias`` is added to the model's logits;
2. masks set logits to -inf: the structured-output token bitmask, ``allowed_token_ids``, and the
   banned tokens (``bad_words`` whose preceding tokens match, EOS/stop tokens before ``min_tokens``);
3. repetition, then frequency and presence penalties;
4. greedy rows (``temperature == 0``) take the argmax here;
5. the logits are divided by ``temperature``, then top-k, top-p and min-p drop tokens;
6. a token is drawn with the Gumbel-max trick from the row's own random stream: row keys are
   ``fold_in(PRNGKey(seed), step)``, so a seeded request samples the same tokens whatever else is in
   the batch, and each step draws new noise.

Every optional stage is skipped when no row of the batch uses it (static flags, or arrays of width
0), so it costs nothing then. Returned log-probabilities are those of the model (log-softmax of the
raw logits, before any of the above).
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.sample.per_row import per_row_fields
from jpaged.sample.sampling_batch import SamplingBatch
from jpaged.sampling_params import PER_ROW_OPTIONS
from jpaged.utils import bucket, pad_rows, padded_ids
from pallas_kernels import cpu


def _static(default):
    """A static `SamplingTensors` field (pytree metadata): a Python value the trace depends on, not an array."""
    return dataclasses.field(default=default, metadata={"static": True})


@jax.tree_util.register_dataclass
@dataclasses.dataclass
@per_row_fields(jax.Array)
class SamplingTensors:
    """The sampler's inputs, padded to the row bucket [S]: an array per per-row option of
    `SamplingParams` (`PER_ROW_OPTIONS`: ``temperature``, ``top_k``, ``top_p``, ``min_p``,
    ``min_tokens``, the penalties; keyword-only fields added by `per_row_fields`, of the dtype each
    declares), and the special inputs below; token-id arrays are padded with -1.

    A ``[S, 0]`` array means no row of the batch uses that option: its stage is not traced.
    """

    seeds: jax.Array              # uint32 [S]
    steps: jax.Array              # int32 [S]: tokens this sequence has generated so far
    output_token_ids: jax.Array   # [S, Lo] (Lo = 0 without penalties)
    prompt_token_ids: jax.Array   # [S, Lp]
    banned_token_ids: jax.Array   # [S, Lb]
    bias_token_ids: jax.Array     # [S, Lx] logit_bias keys
    bias_values: jax.Array        # [S, Lx] float32 logit_bias values
    allowed_token_ids: jax.Array  # [S, La]
    has_allowed: jax.Array        # bool [S]: the row restricts itself to allowed_token_ids
    token_bitmask: jax.Array      # int32 [S, W]: bit v % 32 of word v // 32 allows token v (W = 0: none)
    num_logprobs: int = _static(0)         # top logprobs to return per row
    use_filters: bool = _static(False)     # any top-k / top-p / min-p
    use_penalties: bool = _static(False)   # any penalty
    all_greedy: bool = _static(True)       # no row samples: skip the random numbers
    processed_logprobs: bool = _static(False)  # logprobs of the distribution sampled from, not the model's


_PER_ROW_ARRAYS = [(name, option.pad, np.dtype(option.dtype)) for name, option in PER_ROW_OPTIONS.items()]


def _per_row_arrays(batch: SamplingBatch, s_pad: int) -> dict[str, np.ndarray]:
    """Each per-row option's ``[s_pad]`` array: its rows' values, then its pad."""
    fill = s_pad - batch.num_rows
    return {name: np.array(getattr(batch, name) + [pad] * fill if fill else getattr(batch, name), dtype)
            for name, pad, dtype in _PER_ROW_ARRAYS}


def sampling_tensors(batch: SamplingBatch, s_pad: int, processed_logprobs: bool = False) -> SamplingTensors:
    """``batch``'s rows padded to ``s_pad`` (greedy rows that allow every token); token-id lists
    padded with -1 to a power-of-two width, 0 for an option no row uses, so shapes come from a small
    set and an unused stage is not traced. ``processed_logprobs``: the engine's ``logprobs_mode``."""
    pad = s_pad - batch.num_rows
    empty = np.zeros((s_pad, 0), np.int32)
    mask = np.full((s_pad, batch.token_bitmask.shape[1]), -1, np.int32)
    mask[:batch.num_rows] = batch.token_bitmask
    bias = batch.bias
    return SamplingTensors(
        **_per_row_arrays(batch, s_pad),
        seeds=np.array(list(batch.seeds) + [0] * pad, np.uint32),
        steps=np.array(list(batch.steps) + [0] * pad, np.int32),
        output_token_ids=pad_rows(batch.output_token_ids, s_pad) if batch.use_penalties else empty,
        prompt_token_ids=pad_rows(batch.prompt_token_ids, s_pad) if batch.use_penalties else empty,
        banned_token_ids=pad_rows(batch.banned_token_ids, s_pad),
        bias_token_ids=pad_rows([[t for t, _ in b] for b in bias], s_pad),
        bias_values=pad_rows([[v for _, v in b] for b in bias], s_pad, fill=0.0, dtype=np.float32),
        allowed_token_ids=pad_rows(batch.allowed_token_ids, s_pad),
        has_allowed=np.array([bool(a) for a in batch.allowed_token_ids] + [False] * pad),
        token_bitmask=mask,
        num_logprobs=bucket(batch.num_logprobs, 0),
        use_filters=batch.use_filters,
        use_penalties=batch.use_penalties,
        all_greedy=batch.all_greedy,
        processed_logprobs=processed_logprobs)


def _token_counts(token_ids, vocab_size):
    """[S, L] ids (-1 = none) -> [S, V] counts."""
    rows = jnp.arange(token_ids.shape[0])[:, None]
    ids = jnp.where(token_ids < 0, vocab_size, token_ids)
    counts = jnp.zeros((token_ids.shape[0], vocab_size), jnp.int32)
    return counts.at[rows, ids].add(1, mode="drop")


def apply_logit_bias(logits, t: SamplingTensors):
    rows = jnp.arange(logits.shape[0])[:, None]
    ids = jnp.where(t.bias_token_ids < 0, logits.shape[-1], t.bias_token_ids)
    return logits.at[rows, ids].add(t.bias_values, mode="drop")


def unpack_bitmask(bitmask, vocab_size):
    """[S, W] int32 words -> [S, V] bool (token v allowed iff bit v % 32 of word v // 32 is set)."""
    v = jnp.arange(vocab_size)
    return ((bitmask[:, v // 32] >> (v % 32)) & 1).astype(bool)


def apply_masks(logits, t: SamplingTensors):
    """Structured-output bitmask, allowed_token_ids, banned tokens -> -inf. The grammar always holds:
    ``allowed_token_ids`` and bans (``bad_words``, EOS before ``min_tokens``) give way where they
    would leave a row no token at all."""
    rows = jnp.arange(logits.shape[0])[:, None]
    vocab = logits.shape[-1]
    if t.token_bitmask.shape[1]:
        logits = jnp.where(unpack_bitmask(t.token_bitmask, vocab), logits, -jnp.inf)
    if t.allowed_token_ids.shape[1]:
        ids = jnp.where(t.allowed_token_ids < 0, vocab, t.allowed_token_ids)
        allowed = jnp.zeros(logits.shape, bool).at[rows, ids].set(True, mode="drop")
        kept = jnp.where(allowed | ~t.has_allowed[:, None], logits, -jnp.inf)
        logits = jnp.where(jnp.isfinite(kept).any(axis=-1, keepdims=True), kept, logits)
    if t.banned_token_ids.shape[1]:  # a ban that would leave no token yields (e.g. a grammar that
        ids = jnp.where(t.banned_token_ids < 0, vocab, t.banned_token_ids)  # allows only EOS)
        banned = logits.at[rows, ids].set(-jnp.inf, mode="drop")
        logits = jnp.where(jnp.isfinite(banned).any(axis=-1, keepdims=True), banned, logits)
    return logits


def apply_penalties(logits, t: SamplingTensors):
    """Repetition penalty on every token seen (prompt or output): positive logits divided by it,
    negative ones multiplied; then ``frequency * count`` and ``presence * (count > 0)`` subtracted,
    counting output tokens only."""
    vocab = logits.shape[-1]
    out_counts = _token_counts(t.output_token_ids, vocab)
    seen = (out_counts + _token_counts(t.prompt_token_ids, vocab)) > 0
    rp = t.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    logits = logits - t.frequency_penalty[:, None] * out_counts
    return logits - t.presence_penalty[:, None] * (out_counts > 0)


def apply_filters(logits, t: SamplingTensors):
    """Top-k, then top-p, then min-p, on temperature-scaled logits (masked entries -> -inf).

    top-k keeps the k largest logits (ties with the k-th kept too); top-p keeps, in descending
    order, each token whose preceding probability mass (after top-k) is < top_p, so the smallest
    prefix reaching top_p; min-p keeps tokens whose probability is >= min_p times the largest.
    """
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


def argmax(x):
    """``jnp.argmax`` over the last axis (the first of equal maxima), as two plain reductions: XLA
    CPU runs argmax's (value, index) reduction several times slower. A row with a NaN gives an
    index in range (the last where the max is NaN; XLA's CPU max may skip a NaN)."""
    vocab = x.shape[-1]
    best = jnp.max(x, axis=-1, keepdims=True)
    first = jnp.min(jnp.where(x == best, jnp.arange(vocab, dtype=jnp.int32), vocab), axis=-1)
    return jnp.minimum(first, vocab - 1)


def greedy_reductions(logits):
    """(`argmax`, log-sum-exp) of every row: on a CPU, in one C++ call (`pallas_kernels.cpu.greedy`) that
    reads each row while it is in the cache, not XLA's several passes over the whole batch (a row
    with a NaN gives the last index there)."""
    if cpu.runs("greedy", logits):
        return cpu.greedy(logits)
    return argmax(logits), jax.nn.logsumexp(logits, axis=-1)


def sample(logits, t: SamplingTensors):
    """logits [S, V] float32 -> (tokens [S], logprobs [S], top_ids [S, K], top_logprobs [S, K])."""
    raw_logits = logits
    if t.bias_token_ids.shape[1]:
        logits = apply_logit_bias(logits, t)
    logits = apply_masks(logits, t)
    if t.use_penalties:
        logits = apply_penalties(logits, t)
    if t.all_greedy and logits is raw_logits:  # nothing changed the logits: one pass for both
        tokens, log_norm = greedy_reductions(logits)
        return _with_logprobs(tokens, raw_logits, t.num_logprobs, log_norm)
    greedy_tokens = argmax(logits)
    if t.all_greedy:
        return _with_logprobs(greedy_tokens, logits if t.processed_logprobs else raw_logits, t.num_logprobs)
    scaled = logits / jnp.where(t.temperature > 0, t.temperature, 1.0)[:, None]
    if t.use_filters:
        scaled = apply_filters(scaled, t)
    keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(t.seeds, t.steps)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (logits.shape[-1],), jnp.float32))(keys)
    sampled = argmax(scaled + gumbel)
    tokens = jnp.where(t.temperature > 0, sampled, greedy_tokens).astype(jnp.int32)
    # processed: what each row was sampled from (greedy rows: the logits after bias, masks, penalties)
    processed = jnp.where((t.temperature > 0)[:, None], scaled, logits) if t.processed_logprobs else raw_logits
    return _with_logprobs(tokens, processed, t.num_logprobs)


def _with_logprobs(tokens, logits, num_logprobs, log_norm=None):
    """The model's log-probabilities (log-softmax of ``logits``) of ``tokens`` and of each row's
    ``num_logprobs`` likeliest tokens, without forming the whole [S, V] log-softmax; ``log_norm``:
    the rows' log-sum-exp, where it is known already."""
    if log_norm is None:
        log_norm = jax.nn.logsumexp(logits, axis=-1)
    log_norm = log_norm[:, None]
    token_logprobs = (jnp.take_along_axis(logits, tokens[:, None], axis=-1) - log_norm)[:, 0]
    num_logprobs = min(num_logprobs, logits.shape[-1])  # the bucket may exceed a tiny vocabulary
    if num_logprobs:
        top_logits, top_ids = jax.lax.top_k(logits, num_logprobs)
        top_logprobs = top_logits - log_norm
    else:
        top_logprobs = jnp.zeros((tokens.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((tokens.shape[0], 0), jnp.int32)
    return tokens, token_logprobs, top_ids.astype(jnp.int32), top_logprobs


# Prompt logprobs (``SamplingParams.prompt_logprobs``) ------------------------------------------
@functools.partial(jax.tree_util.register_dataclass, data_fields=["indices", "targets"],
                   meta_fields=["num_logprobs"])
@dataclasses.dataclass
class PromptLogprobTensors:
    """The prompt positions of a step whose logprobs were asked for (``prompt_logprobs``)."""

    indices: jax.Array   # int32 [Tp]: rows of the step's hidden states (padded with 0)
    targets: jax.Array   # int32 [Tp]: the prompt token each row predicts
    num_logprobs: int = 0  # top alternatives per row (static)


def prompt_logprobs(logits, t: PromptLogprobTensors):
    """logits [Tp, V] -> (target logprobs [Tp], top ids [Tp, k], top logprobs [Tp, k])."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    target = jnp.take_along_axis(logprobs, t.targets[:, None], axis=-1)[:, 0]
    k = min(t.num_logprobs, logits.shape[-1])
    if k:
        top_lps, top_ids = jax.lax.top_k(logprobs, k)
    else:
        top_lps, top_ids = jnp.zeros((logits.shape[0], 0)), jnp.zeros((logits.shape[0], 0), jnp.int32)
    return target, top_ids.astype(jnp.int32), top_lps


def prompt_logprob_tensors(rows, indices: list[int]) -> PromptLogprobTensors | None:
    """``rows``: the step's `PromptLogprobRow`s, ``indices``: the flat token row of each. None when
    no row of the step asks."""
    if not rows:
        return None
    k = max(r.num_logprobs for r in rows)
    return PromptLogprobTensors(padded_ids(indices, fill=0), padded_ids([r.target for r in rows], fill=0),
                                bucket(k, 0))
