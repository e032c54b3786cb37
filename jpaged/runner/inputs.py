"""A step's scheduler output -> the flat, padded host arrays of the jitted step (numpy only).

Tokens of every scheduled sequence are laid end to end (``query_start_loc`` marks where each
sequence starts); padding tokens write nowhere (slot -1), padding sequences have length 0 and
``query_start_loc`` repeating the real token count, block-table rows of padding are block 0.
"""
from dataclasses import dataclass

import numpy as np

from jpaged.core.scheduler_output import SchedulerOutput
from jpaged.runner.buckets import StepBuckets
from jpaged.utils import pad_rows


@dataclass
class StepInputs:
    """T = padded tokens, S = padded sequences, B = padded blocks per sequence, R = padded rows."""

    input_ids: np.ndarray        # int32 [T]
    positions: np.ndarray        # int32 [T]
    slot_mapping: np.ndarray     # int32 [T]: pool slot of each token's K/V, -1 for padding
    query_start_loc: np.ndarray  # int32 [S + 1]
    seq_lens: np.ndarray         # int32 [S]: context including this step's tokens
    block_tables: np.ndarray     # int32 [S, B]
    num_seqs: int
    logits_indices: np.ndarray   # int32 [R]: the token row of each sample row (then 0s)
    prompt_logprob_indices: list[int]  # the token row of each prompt-logprob row

    @property
    def num_rows(self) -> int:
        return self.logits_indices.shape[0]


def prepare_inputs(out: SchedulerOutput, buckets: StepBuckets) -> StepInputs:
    bs = buckets.block_size
    input_ids, positions, slots, seq_lens, tables = [], [], [], [], []
    query_start_loc = [0]
    for seq in out.seqs:
        n = len(seq.token_ids) + len(seq.spec_token_ids)  # proposals are computed after the tokens
        pos = np.arange(seq.start, seq.start + n)
        input_ids.extend(seq.token_ids)
        input_ids.extend(seq.spec_token_ids)
        positions.append(pos)
        slots.append(np.asarray(seq.block_table, np.int32)[pos // bs] * bs + pos % bs)
        seq_lens.append(seq.start + n)
        tables.append(seq.block_table)
        query_start_loc.append(query_start_loc[-1] + n)
    t, s = len(input_ids), len(out.seqs)
    t_pad, s_pad, b_pad = buckets.shape(t, s, max(len(tb) for tb in tables))
    qsl = np.full(s_pad + 1, t, np.int32)
    qsl[:s + 1] = query_start_loc
    ids = np.zeros(t_pad, np.int32)
    ids[:t] = input_ids
    sampled = [query_start_loc[r.seq_row] + len(out.seqs[r.seq_row].token_ids) - 1 + r.spec_index
               for r in out.sample_rows]
    rows = np.zeros(buckets.rows(len(sampled), t_pad), np.int32)
    rows[:len(sampled)] = sampled
    return StepInputs(
        input_ids=ids,
        positions=np.concatenate(positions + [np.zeros(t_pad - t, np.int64)]).astype(np.int32),
        slot_mapping=np.concatenate(slots + [np.full(t_pad - t, -1, np.int32)]).astype(np.int32),
        query_start_loc=qsl,
        seq_lens=np.array(seq_lens + [0] * (s_pad - s), np.int32),
        block_tables=pad_rows(tables, s_pad, b_pad, fill=0),
        num_seqs=s,
        logits_indices=rows,
        prompt_logprob_indices=[query_start_loc[r.seq_row] + r.position - out.seqs[r.seq_row].start
                                for r in out.prompt_logprob_rows])
