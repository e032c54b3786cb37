"""Host side of sampling: the rows of one step -> padded `SamplingTensors` for the jitted sampler.

Per-row arrays are padded to ``s_pad`` rows; token-id lists to a power-of-two width (``-1`` = none),
so shapes come from a small set. An option no row uses gets width 0 and is not traced.
"""
import zlib

import numpy as np

from jpaged import structured_output
from jpaged.sampler import SamplingTensors
from jpaged.utils import bucket, pad_rows




def banned_tokens(request, seq) -> list[int]:
    """Tokens the row may not emit now: EOS and stop tokens before ``min_tokens``, and the last token
    of each bad word whose preceding tokens end the output so far."""
    p = request.sampling_params
    banned = []
    if seq.num_output_tokens < p.min_tokens:
        banned += list(request.eos_token_ids) + p.stop_token_ids
    output = seq.output_token_ids
    for word in getattr(p, "_bad_word_ids", ()):
        prefix = word[:-1]
        if not prefix or (len(output) >= len(prefix) and output[len(output) - len(prefix):] == prefix):
            banned.append(word[-1])
    return banned


def _token_bitmask(rows, s_pad: int) -> np.ndarray:
    """[s_pad, W] int32 words of allowed tokens (all bits set for unconstrained rows); W = 0 when no
    row is constrained. Creates a sequence's grammar state on its first step and brings it up to
    date with the sequence's output tokens."""
    grammars = [getattr(row.request.sampling_params, "_grammar", None) for row in rows]
    width = max((g.bitmask_width for g in grammars if g is not None), default=0)
    mask = np.full((s_pad, width), -1, np.int32)
    filled, copies, active = {}, [], []  # the n first-step rows of one sequence share its state
    for i, (row, grammar) in enumerate(zip(rows, grammars)):
        if grammar is None:
            continue
        seq = row.seq
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
            seq.structured.fill_bitmask(mask[i, :grammar.bitmask_width], row.request.eos_token_ids)
            mask[i, grammar.bitmask_width:] = 0
    if active:
        structured_output.fill_bitmasks(active, mask)
    for i, j in copies:
        mask[i] = mask[j]
    return mask


def build_sampling_tensors(rows, s_pad: int, engine_seed: int) -> SamplingTensors:
    """``rows``: SampleRow-like (``.request``, ``.seq``, ``.sample_index``), at most ``s_pad``."""
    pad = s_pad - len(rows)
    params = [row.request.sampling_params for row in rows]
    f32 = lambda vals, fill: np.array(vals + [fill] * pad, np.float32)  # noqa: E731
    seeds = []
    for row, p in zip(rows, params):
        base = p.seed if p.seed is not None else f"{engine_seed}/{row.request.request_id}"
        seeds.append(zlib.crc32(f"{base}/{row.sample_index}".encode()))
    use_penalties = any(p.uses_penalties for p in params)
    empty = np.zeros((s_pad, 0), np.int32)
    out_ids = pad_rows([row.seq.output_token_ids for row in rows], s_pad) if use_penalties else empty
    prompt_ids = (pad_rows([row.seq.token_ids[:row.seq.num_prompt_tokens] for row in rows], s_pad)
                  if use_penalties else empty)
    biases = [sorted((p.logit_bias or {}).items()) for p in params]
    allowed = [list(p.allowed_token_ids or []) for p in params]
    return SamplingTensors(
        temperature=f32([p.temperature for p in params], 0.0),
        top_k=np.array([p.top_k for p in params] + [0] * pad, np.int32),
        top_p=f32([p.top_p for p in params], 1.0),
        min_p=f32([p.min_p for p in params], 0.0),
        seeds=np.array(seeds + [0] * pad, np.uint32),
        steps=np.array([row.seq.num_output_tokens for row in rows] + [0] * pad, np.int32),
        presence_penalty=f32([p.presence_penalty for p in params], 0.0),
        frequency_penalty=f32([p.frequency_penalty for p in params], 0.0),
        repetition_penalty=f32([p.repetition_penalty for p in params], 1.0),
        output_token_ids=out_ids,
        prompt_token_ids=prompt_ids,
        banned_token_ids=pad_rows([banned_tokens(row.request, row.seq) for row in rows], s_pad),
        bias_token_ids=pad_rows([[t for t, _ in b] for b in biases], s_pad),
        bias_values=pad_rows([[v for _, v in b] for b in biases], s_pad, fill=0.0, dtype=np.float32),
        allowed_token_ids=pad_rows(allowed, s_pad),
        has_allowed=np.array([bool(a) for a in allowed] + [False] * pad),
        token_bitmask=_token_bitmask(rows, s_pad),
        num_logprobs=bucket(max(((p.logprobs or 0) for p in params), default=0), 0),
        use_filters=any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params),
        use_penalties=use_penalties,
        all_greedy=all(p.temperature == 0 for p in params))
