"""The padded sizes of a step, so that the jitted step compiles a bounded number of times.

Every size follows from the step's token count alone (and, for sampled rows, from the rows that
sample): tokens to a step bucket (`jpaged.utils.step_bucket`: 2, 4, 8, 16, 24, 32, 48, 64, then
quarter steps to 256, then half steps), sequences to as many rows as tokens (at most the
``max_num_seqs`` bucket, unless forking samples makes more), and block-table columns to those of
``max_model_len`` on the ``xla`` backend (its attention loops only over real rows and blocks, so
the padding costs no work) or to the step's longest table's power of two on the ``pallas`` backend
(the Pallas kernels keep block tables in scalar memory). Pure functions of integers: no model.
"""
from dataclasses import dataclass

from jpaged.utils import bucket, cdiv, step_bucket

MIN_TOKENS = 2  # XLA CPU runs [1, K] x [K, N] matmuls far slower than [2, K]
MIN_ROWS = 2


@dataclass(frozen=True)
class StepBuckets:
    max_num_seqs: int
    max_model_len: int
    block_size: int
    attention_backend: str = "xla"
    num_speculative_tokens: int = 0  # a verification step samples up to this many rows more per sequence
    num_kv_groups: int = 1  # KV-cache groups: a block table (and slot mapping) each

    @property
    def max_num_rows(self) -> int:
        """The most sample rows a step can have: every sequence's, and a row per proposal."""
        return self.max_num_seqs * (1 + self.num_speculative_tokens)

    @property
    def max_seqs_bucket(self) -> int:
        return step_bucket(self.max_num_seqs, MIN_ROWS)

    @property
    def max_blocks_per_seq(self) -> int:
        return cdiv(self.max_model_len, self.block_size)

    def shape(self, num_tokens: int, num_seqs: int, num_blocks: int) -> tuple[int, int, int]:
        """Padded (tokens, sequences, blocks per sequence) of a step."""
        t_pad = step_bucket(num_tokens, MIN_TOKENS)
        s_pad = max(min(t_pad, self.max_seqs_bucket), step_bucket(num_seqs, MIN_ROWS))
        if self.attention_backend == "xla":
            return t_pad, s_pad, bucket(self.max_blocks_per_seq)
        return t_pad, s_pad, bucket(num_blocks, 4)

    @staticmethod
    def rows(num_rows: int, t_pad: int) -> int:
        """The padded sampled-row count of a step of ``t_pad`` padded tokens: the step bucket where
        the rows fill the step (decode), else a power of two of at most ``t_pad``. A step with
        prompt tokens samples few rows, and the coarse sizes keep the (tokens, rows) pairs that
        compile few."""
        fine = step_bucket(num_rows, MIN_ROWS)
        return fine if fine >= t_pad else min(bucket(num_rows, MIN_ROWS), t_pad)

    @staticmethod
    def token_buckets(max_tokens: int) -> list[int]:
        """Every padded token count a step of at most ``max_tokens`` tokens can have."""
        sizes = [step_bucket(MIN_TOKENS)]
        while sizes[-1] < step_bucket(max_tokens, MIN_TOKENS):
            sizes.append(step_bucket(sizes[-1] + 1))
        return sizes

    def row_buckets(self, t_pad: int) -> list[int]:
        """Every padded sampled-row count a step of ``t_pad`` padded tokens can have."""
        return sorted({self.rows(r, t_pad) for r in range(1, min(t_pad, self.max_num_rows) + 1)})
