"""A roofline estimate of a deployment: lower bounds on step time, upper bounds on throughput.

An estimate from the chip's published figures (`pallas_kernels.aot.targets.Target`: HBM bandwidth
and dense bfloat16 peak, with their source), never a measurement. A step takes at least the
longer of the bytes it must read from HBM over the bandwidth and the FLOPs it must compute over
the peak, per chip (tensor parallelism splits both):

- bytes: the weights on the chip (the input-embedding table excepted, of which a step reads only
  its tokens' rows; of stacked experts the share a step's rows are expected to route to, uniform
  routing: ``1 - (1 - k/E) ** rows``), plus the KV pages every row attends to (a windowed layer:
  its window), plus, for a prompt, the KV it writes;
- FLOPs: ``2 x`` the matmul weights per token (experts: ``k/E`` of them), plus attention's
  ``4 x`` query heads ``x`` head size per key attended, per layer.

What it leaves out only makes a real step slower: activations and temporaries, collectives,
kernel launch and host time, the sampler. The workload (`WORKLOAD`: tpu-inference's CI serving
workload, 1,800 prompt / 128 output tokens per request) runs as batches of as many requests as the
engine holds at once: every prompt (in steps of ``max_num_batched_tokens`` tokens, each reading
the weights), then one decode step per further output token at the batch's growing context.
"""
import dataclasses

import numpy as np

from jpaged.core.kv_cache_layout import RECURRENT_GROUP
from jpaged.utils import cdiv

WORKLOAD = (1800, 128)  # (prompt tokens, output tokens) per request
LABEL = ("estimate, not a measurement: lower bounds on step time and upper bounds on throughput from "
         "the chip's published HBM bandwidth and dense bf16 peak")


@dataclasses.dataclass(frozen=True)
class StepCost:
    """What a model's steps read and compute on one chip.

    Attributes:
      weight_bytes: weights every step reads (the input-embedding table excluded), stacked experts included.
      expert_bytes: of those, the stacked experts'.
      dense_params: matmul weight elements every token multiplies by (the tied embedding as the
        output projection included).
      expert_params: stacked expert weight elements (a token uses ``experts_per_token / num_experts``).
      num_experts: experts per MoE layer (0: a dense model).
      experts_per_token: experts each token is routed to.
      kv_bytes_per_token_layer: KV bytes of one token in one layer (keys and values, scales included).
      layer_windows: per attention layer, its sliding window, or None (global).
      attention_width: query heads on the chip x head size.
      state_bytes_per_seq: a sequence's recurrent states (linear-attention layers) on the chip, which
        every step reads and writes once.
    """

    weight_bytes: int
    expert_bytes: int
    dense_params: int
    expert_params: int
    num_experts: int
    experts_per_token: int
    kv_bytes_per_token_layer: float
    layer_windows: tuple
    attention_width: int
    state_bytes_per_seq: int = 0

    def expert_share(self, rows: int) -> float:
        """The expected share of stacked experts that ``rows`` tokens route to (uniform routing)."""
        if not self.num_experts:
            return 0.0
        return 1.0 - (1.0 - self.experts_per_token / self.num_experts) ** rows

    def keys(self, context: int) -> int:
        """Keys one query at ``context`` attends to, summed over layers."""
        return sum(context if w is None else min(context, w) for w in self.layer_windows)

    def flops_per_token(self) -> float:
        share = self.experts_per_token / self.num_experts if self.num_experts else 0.0
        return 2.0 * (self.dense_params + share * self.expert_params)

    def weights_read(self, rows: int) -> float:
        return self.weight_bytes - self.expert_bytes + self.expert_share(rows) * self.expert_bytes


@dataclasses.dataclass(frozen=True)
class Bound:
    """A step's floor on one chip: its bytes and FLOPs, and the time each takes at the chip's figures."""

    rows: int
    context: int
    bytes: float
    flops: float
    memory_seconds: float
    compute_seconds: float

    @property
    def seconds(self) -> float:
        return max(self.memory_seconds, self.compute_seconds)

    @property
    def bound_by(self) -> str:
        return "compute" if self.compute_seconds > self.memory_seconds else "memory"


def _bound(rows, context, nbytes, flops, chip) -> Bound:
    return Bound(rows, context, nbytes, flops, nbytes / chip.hbm_bytes_per_s, flops / chip.peak_flops)


def decode_step(cost: StepCost, chip, rows: int, context: int) -> Bound:
    """The floor of a decode step of ``rows`` sequences, each attending to ``context`` tokens."""
    keys = cost.keys(context)
    nbytes = cost.weights_read(rows) + rows * (keys * cost.kv_bytes_per_token_layer + 2 * cost.state_bytes_per_seq)
    flops = rows * (cost.flops_per_token() + 4.0 * cost.attention_width * keys)
    return _bound(rows, context, nbytes, flops, chip)


def causal_keys(tokens: int, window: int | None) -> int:
    """Keys a causal prompt of ``tokens`` attends to in one layer, summed over its queries."""
    if window is None or tokens <= window:
        return tokens * (tokens + 1) // 2
    return window * (window + 1) // 2 + (tokens - window) * window


def prompt(cost: StepCost, chip, tokens: int) -> Bound:
    """The floor of computing one prompt of ``tokens`` tokens in one step (its KV written)."""
    keys = sum(causal_keys(tokens, w) for w in cost.layer_windows)
    nbytes = (cost.weights_read(tokens) + tokens * len(cost.layer_windows) * cost.kv_bytes_per_token_layer
              + 2 * cost.state_bytes_per_seq)
    flops = tokens * cost.flops_per_token() + 4.0 * cost.attention_width * keys
    return _bound(tokens, tokens, nbytes, flops, chip)


def workload(cost: StepCost, chip, batch: int, max_batched_tokens: int, prompt_tokens: int = WORKLOAD[0],
             output_tokens: int = WORKLOAD[1]) -> dict:
    """The floor of serving requests of ``prompt_tokens`` / ``output_tokens`` in batches of
    ``batch``: every prompt of a batch (the weights read once per step of ``max_batched_tokens``
    tokens), then ``output_tokens - 1`` decode steps (the prompt's step gives the first token).
    Returns the batch's least seconds and the most output tokens/s and requests/s per deployment."""
    if batch < 1:
        return {"batch": 0, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens, "seconds": None,
                "output_tokens_per_s": 0.0, "requests_per_s": 0.0}
    one = prompt(cost, chip, prompt_tokens)
    passes = cdiv(batch * prompt_tokens, max_batched_tokens)
    compute = batch * one.flops / chip.peak_flops
    memory = (passes * cost.weights_read(min(max_batched_tokens, batch * prompt_tokens))
              + batch * (one.bytes - cost.weights_read(prompt_tokens))) / chip.hbm_bytes_per_s
    seconds = max(compute, memory)
    seconds += sum(decode_step(cost, chip, batch, prompt_tokens + i).seconds for i in range(1, output_tokens))
    return {"batch": batch, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens, "seconds": seconds,
            "output_tokens_per_s": batch * output_tokens / seconds, "requests_per_s": batch / seconds}


TOKEN_TABLES = ("embed_tokens", "wte")  # input-embedding modules (the output projection too when tied)
POSITION_TABLES = ("embed_positions", "wpe")  # learned position tables: a step reads its positions' rows


def step_cost(named_leaves, *, config, layout, kv_bytes_per_block: int, block_size: int, tensor_parallel_size: int,
              is_expert, state_bytes_per_seq: int = 0) -> StepCost:
    """The `StepCost` of a model from its parameters on one chip: ``named_leaves`` (path names,
    per-chip shape, dtype item size) and ``is_expert(names)`` (a stacked expert weight ``[E', ...]``);
    ``state_bytes_per_seq``: a sequence's recurrent states on the chip (recurrent layers attend to no keys)."""
    weight = expert = dense = expert_params = 0
    for names, shape, itemsize in named_leaves:
        size = int(np.prod(shape))
        if any(n in POSITION_TABLES for n in names):
            continue
        if any(n in TOKEN_TABLES for n in names) and not config.tie_word_embeddings:
            continue  # the input table: a step reads its tokens' rows
        weight += size * itemsize
        if is_expert(names):
            expert += size * itemsize
            expert_params += size
        elif len(shape) >= 2:
            dense += size
    hf = config.hf or {}
    windows = tuple(layout.group_windows[g] for g, _ in layout.layers if g != RECURRENT_GROUP)
    return StepCost(
        weight_bytes=weight, expert_bytes=expert, dense_params=dense, expert_params=expert_params,
        num_experts=int(hf.get("num_local_experts") or hf.get("num_experts") or 0) if expert else 0,
        experts_per_token=int(hf.get("num_experts_per_tok") or 0) if expert else 0,
        kv_bytes_per_token_layer=kv_bytes_per_block / (block_size * layout.num_tensors),
        layer_windows=windows or (None,) * config.num_layers,
        attention_width=max(1, config.num_heads // tensor_parallel_size) * config.head_dim,
        state_bytes_per_seq=state_bytes_per_seq)


def estimate(cost: StepCost, chip, *, decode_rows, fit_batch: int, max_batched_tokens: int,
             max_model_len: int) -> dict:
    """The roofline block of `jpaged.entrypoints.aot.EngineCompile`: the chip's figures and source,
    per decode step shape (``decode_rows``) its floor at the workload's mean context, and the
    workload at ``fit_batch`` requests at once (none where its requests pass ``max_model_len``,
    with a ``note`` saying why)."""
    prompt_tokens, output_tokens = WORKLOAD
    tokens = prompt_tokens + output_tokens
    note = (f"max_model_len={max_model_len} is below the workload's {tokens} tokens per request"
            if tokens > max_model_len else "" if fit_batch > 0 else f"not one request of {tokens} tokens fits the pool")
    context = prompt_tokens + output_tokens // 2
    steps = []
    for rows in decode_rows:
        b = decode_step(cost, chip, rows, context)
        steps.append({"rows": rows, "context": context, "bytes": b.bytes, "flops": b.flops,
                      "min_step_ms": b.seconds * 1e3, "max_output_tokens_per_s": rows / b.seconds,
                      "bound_by": b.bound_by})
    served = workload(cost, chip, 0 if note else fit_batch, max_batched_tokens)
    return {"label": LABEL, "chip": chip.name, "hbm_bytes_per_s": chip.hbm_bytes_per_s,
            "peak_flops": chip.peak_flops, "source": chip.spec_url, "decode_steps": steps,
            "workload": served | ({"note": note} if note else {})}
