"""A step's scheduler output -> the flat, padded host arrays of the jitted step (numpy only).

Tokens of every scheduled sequence are laid end to end (``query_start_loc`` marks where each
sequence starts); padding tokens write nowhere (slot -1), padding sequences have length 0 and
``query_start_loc`` repeating the real token count, block-table rows of padding are block 0, and
so are the entries a sliding window released (-1 on the host: the attention never reads them).
A model with several KV-cache groups gets a block table and slot mapping per group. A model
served with LoRA adapters gets each token's adapter slot (padding: slot 0, the base model) and the
tokens' order by slot (`lora_inputs`). A model with recurrent layers gets each sequence's state
slot (padding: -1, neither read nor written).
"""
from dataclasses import dataclass

import numpy as np

from jpaged.core.scheduler_output import SchedulerOutput
from jpaged.models.lora import LoRAInputs
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
    group_slot_mappings: np.ndarray | None = None  # int32 [G-1, T]: KV-cache groups 1.. (None: one group)
    group_block_tables: np.ndarray | None = None   # int32 [G-1, S, B]
    lora: LoRAInputs | None = None  # each token's adapter slot and the slot grouping (None: no LoRA)
    state_slots: np.ndarray | None = None  # int32 [S]: recurrent-state slots, -1 for padding (None: no state)

    @property
    def num_rows(self) -> int:
        return self.logits_indices.shape[0]


def _slots(table: list[int], positions: np.ndarray, block_size: int) -> np.ndarray:
    blocks = np.asarray(table, np.int32)[positions // block_size]
    if (blocks < 0).any():
        raise RuntimeError("a step writes into a block its sliding window released")
    return blocks * block_size + positions % block_size


def lora_inputs(token_slots: np.ndarray, num_slots: int) -> LoRAInputs:
    """The `LoRAInputs` of a step whose (padded) tokens use these adapter slots."""
    slots = np.asarray(token_slots, np.int32)
    order = np.argsort(slots, kind="stable").astype(np.int32)
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order), dtype=np.int32)
    return LoRAInputs(slots=slots, order=order, inverse=inverse,
                      group_sizes=np.bincount(slots, minlength=num_slots).astype(np.int32))


def prepare_inputs(out: SchedulerOutput, buckets: StepBuckets, num_groups: int = 1,
                   num_lora_slots: int = 0, recurrent: bool = False) -> StepInputs:
    """The step's arrays; ``num_groups``: the model's KV-cache groups (each sequence brings a table
    for every group after the first in ``group_block_tables``); ``num_lora_slots``: the model's
    adapter slots including slot 0 (0: served without LoRA); ``recurrent``: the model has
    recurrent layers (each sequence's ``state_slot``)."""
    bs = buckets.block_size
    input_ids, positions, seq_lens = [], [], []
    slots, tables = [[] for _ in range(num_groups)], [[] for _ in range(num_groups)]
    query_start_loc = [0]
    for seq in out.seqs:
        n = len(seq.token_ids) + len(seq.spec_token_ids)  # proposals are computed after the tokens
        pos = np.arange(seq.start, seq.start + n)
        input_ids.extend(seq.token_ids)
        input_ids.extend(seq.spec_token_ids)
        positions.append(pos)
        seq_tables = [seq.block_table] + list(seq.group_block_tables)
        if len(seq_tables) != num_groups:
            raise ValueError(f"sequence {seq.seq_id}: {len(seq_tables)} block tables for {num_groups} KV-cache groups")
        for g, table in enumerate(seq_tables):
            slots[g].append(_slots(table, pos, bs))
            tables[g].append(np.maximum(np.asarray(table, np.int32), 0))
        seq_lens.append(seq.start + n)
        query_start_loc.append(query_start_loc[-1] + n)
    t, s = len(input_ids), len(out.seqs)
    t_pad, s_pad, b_pad = buckets.shape(t, s, max(len(tb) for group in tables for tb in group))
    slot_mappings = [np.concatenate(g + [np.full(t_pad - t, -1, np.int32)]).astype(np.int32) for g in slots]
    block_tables = [pad_rows(g, s_pad, b_pad, fill=0) for g in tables]
    qsl = np.full(s_pad + 1, t, np.int32)
    qsl[:s + 1] = query_start_loc
    ids = np.zeros(t_pad, np.int32)
    ids[:t] = input_ids
    lora = None
    if num_lora_slots:
        token_slots = np.zeros(t_pad, np.int32)
        token_slots[:t] = np.repeat([seq.lora_slot for seq in out.seqs], np.diff(query_start_loc))
        lora = lora_inputs(token_slots, num_lora_slots)
    state_slots = None
    if recurrent:
        state_slots = np.full(s_pad, -1, np.int32)
        state_slots[:s] = [seq.state_slot for seq in out.seqs]
    sampled = [query_start_loc[r.seq_row] + len(out.seqs[r.seq_row].token_ids) - 1 + r.spec_index
               for r in out.sample_rows]
    rows = np.zeros(buckets.rows(len(sampled), t_pad), np.int32)
    rows[:len(sampled)] = sampled
    return StepInputs(
        input_ids=ids,
        positions=np.concatenate(positions + [np.zeros(t_pad - t, np.int64)]).astype(np.int32),
        slot_mapping=slot_mappings[0],
        query_start_loc=qsl,
        seq_lens=np.array(seq_lens + [0] * (s_pad - s), np.int32),
        block_tables=block_tables[0],
        num_seqs=s,
        logits_indices=rows,
        prompt_logprob_indices=[query_start_loc[r.seq_row] + r.position - out.seqs[r.seq_row].start
                                for r in out.prompt_logprob_rows],
        group_slot_mappings=np.stack(slot_mappings[1:]) if num_groups > 1 else None,
        group_block_tables=np.stack(block_tables[1:]) if num_groups > 1 else None,
        lora=lora, state_slots=state_slots)
