"""Host side of sampling: the sample rows of one step -> a `SamplingBatch` of plain per-row values.

The scheduler builds it when it schedules a step (it owns request state: building a row's grammar
bitmask brings the sequence's grammar state up to date); the runner pads it into the jitted
sampler's `SamplingTensors` (`jpaged.sample.sampler.sampling_tensors`). Nothing here imports JAX.
"""
import zlib
from dataclasses import dataclass, field
from operator import attrgetter

import numpy as np

from jpaged.sample import structured_output
from jpaged.sample.per_row import per_row_fields
from jpaged.sampling_params import PER_ROW_OPTIONS, SamplingParams


@dataclass
@per_row_fields(list, default_factory=list)
class SamplingBatch:
    """Per sample row (``len(seeds)`` rows), unpadded: a list per per-row option of `SamplingParams`
    (`PER_ROW_OPTIONS`: temperature, top_k, top_p, min_p, min_tokens, the penalties; keyword-only
    fields added by `per_row_fields`), and the rows' special values below. Token-id lists may differ
    in length."""

    seeds: list[int] = field(default_factory=list)        # uint32: the row's random stream
    steps: list[int] = field(default_factory=list)        # output tokens the sequence has so far
    output_token_ids: list[list[int]] = field(default_factory=list)  # only with penalties
    prompt_token_ids: list[list[int]] = field(default_factory=list)  # only with penalties
    banned_token_ids: list[list[int]] = field(default_factory=list)
    bias: list[list[tuple[int, float]]] = field(default_factory=list)  # logit_bias, sorted by id
    allowed_token_ids: list[list[int]] = field(default_factory=list)   # [] allows every token
    token_bitmask: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int32))  # [rows, W]
    num_logprobs: int = 0
    use_filters: bool = False
    use_penalties: bool = False

    @property
    def num_rows(self) -> int:
        return len(self.seeds)

    @property
    def all_greedy(self) -> bool:
        return all(t == 0 for t in self.temperature)


_PER_ROW_NAMES = tuple(PER_ROW_OPTIONS)
_per_row_of = attrgetter(*_PER_ROW_NAMES)  # a tuple per row (there are several options)
_CLAMPS = [(name, option.clamp) for name, option in PER_ROW_OPTIONS.items() if option.clamp is not None]


def per_row_values(params: list[SamplingParams]) -> dict[str, list]:
    """Each per-row option's values over the rows of ``params`` (clamped where it declares a clamp):
    `SamplingBatch`'s per-row fields (empty without rows)."""
    values = {name: list(column) for name, column in zip(_PER_ROW_NAMES, zip(*map(_per_row_of, params)))}
    for name, clamp in _CLAMPS:
        column = values.get(name)
        if column and max(column) > clamp:
            values[name] = [min(v, clamp) for v in column]
    return values


def banned_tokens(request, seq) -> list[int]:
    """Tokens the row may not emit now: EOS and stop tokens before ``min_tokens``, and the last token
    of each bad word whose preceding tokens end the output so far."""
    p = request.sampling_params
    banned = []
    if seq.num_output_tokens < p.min_tokens:
        banned += list(request.eos_token_ids) + p.stop_token_ids
    output = seq.output_token_ids
    for word in request.bad_word_ids:
        prefix = word[:-1]
        if not prefix or (len(output) >= len(prefix) and output[len(output) - len(prefix):] == prefix):
            banned.append(word[-1])
    return banned


def token_bitmask(rows) -> np.ndarray:
    """[rows, W] int32 words of allowed tokens (all bits set for unconstrained rows); W = 0 when no
    row is constrained. Creates a sequence's grammar state on its first step and brings it up to
    date with the sequence's output tokens."""
    grammars = [row[0].grammar for row in rows]
    width = max((g.bitmask_width for g in grammars if g is not None), default=0)
    mask = np.full((len(rows), width), -1, np.int32)
    filled, copies, active = {}, [], []  # the n first-step rows of one sequence share its state
    for i, ((request, seq, _), grammar) in enumerate(zip(rows, grammars)):
        if grammar is None:
            continue
        if seq.seq_id in filled:
            copies.append((i, filled[seq.seq_id]))
            continue
        filled[seq.seq_id] = i
        if seq.structured is None:
            seq.structured = grammar.new_state()
        seq.structured.sync(seq.output_token_ids)
        if seq.structured.active and grammar.bitmask_width == width:
            active.append((seq.structured, i))
        else:
            seq.structured.fill_bitmask(mask[i, :grammar.bitmask_width], request.eos_token_ids)
            mask[i, grammar.bitmask_width:] = 0
    if active:
        structured_output.fill_bitmasks(active, mask)
        for state, i in active:  # failed while computing its mask: EOS only, and the row ends "error"
            if state.error:
                state.fill_bitmask(mask[i, :state.grammar.bitmask_width], rows[i][0].eos_token_ids)
    for i, j in copies:
        mask[i] = mask[j]
    return mask


def build_sampling_batch(rows, engine_seed: int) -> SamplingBatch:
    """``rows``: (request, sequence, sample index) per sample row of the step."""
    params = [request.sampling_params for request, _, _ in rows]
    seeds = []
    for (request, _, index), p in zip(rows, params):
        base = p.seed if p.seed is not None else f"{engine_seed}/{request.request_id}"
        seeds.append(zlib.crc32(f"{base}/{index}".encode()))
    use_penalties = any(p.uses_penalties for p in params)
    return SamplingBatch(
        **per_row_values(params),
        seeds=seeds,
        steps=[seq.num_output_tokens for _, seq, _ in rows],
        output_token_ids=[seq.output_token_ids for _, seq, _ in rows] if use_penalties else [],
        prompt_token_ids=[seq.token_ids[:seq.num_prompt_tokens] for _, seq, _ in rows] if use_penalties else [],
        banned_token_ids=[banned_tokens(request, seq) for request, seq, _ in rows],
        bias=[sorted((p.logit_bias or {}).items()) for p in params],
        allowed_token_ids=[list(p.allowed_token_ids or []) for p in params],
        token_bitmask=token_bitmask(rows),
        num_logprobs=max(((p.logprobs or 0) for p in params), default=0),
        use_filters=any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params),
        use_penalties=use_penalties)
