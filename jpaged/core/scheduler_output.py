"""What one engine step does, as plain data: everything the model runner reads, nothing live, and
what it answers.

The scheduler builds a `SchedulerOutput` each step; the runner turns it into device arrays and
never sees a `Request`, a `Sequence` or the KV cache manager; it returns one `StepResult` per model
step. Ids (``request_id``, ``seq_id``) let the scheduler apply the results to its own objects.
"""
from dataclasses import dataclass, field

import numpy as np

from jpaged.sample.sampling_batch import SamplingBatch


@dataclass
class ScheduledSeq:
    """One sequence's part of a step: compute ``token_ids`` at positions ``start, start + 1, ...``,
    writing their K/V through ``block_table`` (a copy that covers every slot the step writes).

    ``group_block_tables``: the tables of KV-cache groups 1, 2, ... of a model with several (layers
    of different sliding windows); entries a window has released are -1 (never read)."""

    request_id: str
    seq_id: int
    token_ids: list[int]
    start: int
    block_table: list[int]
    # Speculative decoding (docs/speculative.md): proposals computed after ``token_ids``, each read
    # back by a sample row (``spec_index`` 1, 2, ...); and the slots past the step's tokens that the
    # draft model writes while it proposes for the next step. ``block_table`` covers both.
    spec_token_ids: list[int] = field(default_factory=list)
    num_lookahead_tokens: int = 0
    group_block_tables: list[list[int]] = field(default_factory=list)
    lora_slot: int = 0  # the device slot of its request's LoRA adapter (0: the base model)
    state_slot: int = -1  # its recurrent-state slot (`jpaged.core.recurrent_state`; -1: the model has none)


@dataclass
class SampleRow:
    """A row of logits to sample from: the last token of ``seqs[seq_row]``, or its proposal number
    ``spec_index`` (1, 2, ...): the row that verifies the next proposal.

    The first sampling step of a request with ``n > 1`` has n rows on its one prompt sequence
    (``sample_index`` 0..n-1); the scheduler forks the request into its samples once they are drawn.
    """

    seq_row: int
    sample_index: int
    spec_index: int = 0


@dataclass
class PromptLogprobRow:
    """Position ``position`` of ``seqs[seq_row]`` predicts prompt token ``target`` (prompt_logprobs
    with ``num_logprobs`` alternatives)."""

    seq_row: int
    position: int
    target: int
    num_logprobs: int


@dataclass
class ScheduledRequest:
    """A request of the step: each of its scheduled sequences computes ``num_new_tokens`` tokens."""

    request_id: str
    num_new_tokens: int


@dataclass
class SchedulerOutput:
    """Everything one step does.

    ``num_steps`` > 1 makes it a decode window: every sequence decodes one token per step for up to
    that many steps on the device (``block_table``s already cover them), the sampled tokens fed back
    there; the runner's results say how many ran (one, while the window's program compiles).
    ``swap_out`` pairs are (device block, host block), ``swap_in`` pairs (host block, device block).
    Prefix-cache tiers (`jpaged.core.kv_offload`): ``kv_stores`` are (device block, prefix-cache
    key) of cached blocks evicted this step, read before anything the step writes; ``kv_loads``
    (device block, the block's arrays) fill free blocks with tier hits before the step runs.
    ``lora_loads``: LoRA adapters newly given a device slot, written before the step runs.
    ``state_copies``: (source slot, destination slot) recurrent-state copies of forked sequences
    (copy-on-write, `jpaged.core.recurrent_state`), made before the step runs.
    """

    requests: list[ScheduledRequest] = field(default_factory=list)
    seqs: list[ScheduledSeq] = field(default_factory=list)
    sample_rows: list[SampleRow] = field(default_factory=list)
    sampling: SamplingBatch = field(default_factory=SamplingBatch)
    prompt_logprob_rows: list[PromptLogprobRow] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    kv_stores: list[tuple[int, tuple]] = field(default_factory=list)
    kv_loads: list[tuple[int, tuple]] = field(default_factory=list)
    num_steps: int = 1
    preempted: list[str] = field(default_factory=list)
    lora_loads: list[tuple[int, object]] = field(default_factory=list)  # (slot, LoRARequest) to fill first

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) + len(s.spec_token_ids) for s in self.seqs)


@dataclass
class StepResult:
    """Sampled tokens, one per sample row of the step (the runner's answer)."""

    tokens: np.ndarray
    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    prompt_logprobs: tuple | None = None  # (target logprobs, top ids, top logprobs) per prompt row
    prepare_seconds: float = 0.0  # host: copies, swaps, batch, metadata, sampling tensors
    device_seconds: float = 0.0   # dispatch until the sampled tokens are on the host
    # Speculative decoding: per sequence of the step, the proposals it accepted (None: the step
    # verified none), and the draft model's proposals for its next step ([seqs, k]; None: no draft)
    num_accepted: np.ndarray | None = None
    draft_token_ids: np.ndarray | None = None

    @property
    def num_token_steps(self) -> int:
        """How many tokens a sequence can take from this result: 1, or 1 + the most proposals any
        sequence accepted (`Scheduler.update_from_output` applies them one position at a time)."""
        if self.num_accepted is None or not len(self.num_accepted):
            return 1
        return 1 + int(np.max(self.num_accepted))
