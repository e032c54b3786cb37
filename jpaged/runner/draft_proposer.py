"""The draft model: proposals from a smaller model with the target's tokenizer, made on the device.

The draft has its own KV pool with the target's block ids and block size, and reads it through
the target's block tables: one allocation serves both, so copy-on-write copies, swaps, frees and
prefix-cache hits apply to both pools with the same block pairs, and nothing in the scheduler or
the KV cache manager knows the draft exists (its bytes per block are added to the target's when
the pool is sized). Each step, after the target's step:

1. the draft computes the K/V of every token the target computed (the same flat batch and
   attention metadata), so its pool holds what the target's does;
2. on the device, each sampling sequence's accepted proposals are counted
   (`rejection_sampler.leading_matches`) and the draft runs ``k`` greedy decode steps from the
   token the step ended with (`runner.decode_window`'s loop), writing its K/V into the slots the
   scheduler reserved past the step (``num_lookahead_tokens``);
3. the ``k`` proposals come back with the step's sampled tokens (no extra host round trip) and are
   verified in the sequence's next step.

A greedy proposal is a single token, so verification is the rejection rule for a point mass
(`jpaged.sample.rejection_sampler`). The draft's K/V only steers proposals: whatever it holds, the
output is the target's. The draft is traced whole (it is small by design), two calls per step.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged import sharding
from jpaged.loading.weight_update import WeightTargets, host_copies
from jpaged.models.attention import AttentionMetadata
from jpaged.runner.decode_window import decode_window
from jpaged.runner.kv_pool import KVPool
from jpaged.sample.rejection_sampler import leading_matches, verification_layout
from jpaged.sample.sampler import sampling_tensors


class DraftModelProposer:
    def __init__(self, model, kv_pool: KVPool, *, mesh, num_speculative_tokens: int, attention_backend: str):
        from jpaged.runner.model_runner import plain_sampling

        self.graphdef, state = nnx.split(model)
        self.state = sharding.shard_state(state, mesh)
        self.weight_targets = WeightTargets(self.graphdef, self.state)  # what `update_weights` must match
        self.sleeping_leaves: dict | None = None  # asleep: {path: host array} of every leaf
        self.kv_pool, self.mesh, self.k = kv_pool, mesh, num_speculative_tokens
        self.decode_only = attention_backend == "pallas"  # the loop's steps are decode-only
        self.counter = kv_pool.counter
        self._greedy = functools.lru_cache(maxsize=None)(lambda rows: sampling_tensors(plain_sampling(rows)[0], rows))
        replicated, pool = sharding.replicated(mesh), kv_pool.shardings()
        self._sync = jax.jit(self._forward, donate_argnums=(1,), out_shardings=pool)
        loop = functools.partial(decode_window, self._logits, max_steps=num_speculative_tokens,
                                 block_size=kv_pool.block_size, vocab_size=model.config.vocab_size)
        self._propose = jax.jit(functools.partial(self._accept_and_propose, loop), donate_argnums=(1,),
                                out_shardings=(replicated, pool))

    # Weights and sleep: the draft's own, beside the target's (`ModelRunner`) ----------------------------
    def load_weights(self, leaves: dict) -> None:
        """Serves new draft parameters ({path: array} from ``weight_targets.new_leaves``); asleep,
        they wait for `wake_up`."""
        targets = self.weight_targets
        if self.sleeping_leaves is not None:
            self.sleeping_leaves.update(leaves)
            return
        flat = dict(zip(targets.paths, jax.tree.leaves(self.state)))
        flat.update(leaves)
        self.state = targets.state(flat)

    def sleep(self) -> None:
        """The draft's leaves to host memory (at either level: a trainer updates the target's)."""
        self.sleeping_leaves = dict(zip(self.weight_targets.paths, host_copies(jax.tree.leaves(self.state))))
        self.state = None

    def wake_up(self) -> None:
        self.state = self.weight_targets.state(self.weight_targets.place_all(self.sleeping_leaves))
        self.sleeping_leaves = None

    def propose(self, out, inputs, md, sampled) -> np.ndarray:
        """Runs the draft after the target's step; [len(out.seqs), k] int32 proposals (rows of
        sequences without ``num_lookahead_tokens`` are -1).

        Args:
          out, inputs, md: the step's `SchedulerOutput`, `StepInputs` and attention metadata.
          sampled: int32 [R]: the step's sampled tokens, still on the device.
        """
        self.kv_pool.caches = self.counter.call("draft_sync", self._sync, self.state, self.kv_pool.caches,
                                                inputs.input_ids, md, num_fixed=2)
        proposing = [i for i, s in enumerate(out.seqs) if s.num_lookahead_tokens]
        s_pad, k = inputs.block_tables.shape[0], self.k
        rows, drafts = verification_layout(out)
        rows_p = np.full((s_pad, k + 1), -1, np.int32)
        drafts_p = np.full((s_pad, k), -1, np.int32)
        rows_p[:len(proposing), :rows.shape[1]] = rows[proposing]
        drafts_p[:len(proposing), :drafts.shape[1]] = drafts[proposing]
        next_pos = np.zeros(s_pad, np.int32)  # the position after each sequence's last real token
        next_pos[:len(proposing)] = [out.seqs[i].start + len(out.seqs[i].token_ids) for i in proposing]
        tables = np.zeros_like(inputs.block_tables)
        tables[:len(proposing)] = inputs.block_tables[proposing]
        tokens = self._run_proposals(sampled, rows_p, drafts_p, next_pos, tables, len(proposing))
        result = np.full((len(out.seqs), k), -1, np.int32)
        result[proposing] = np.asarray(tokens)[:, :len(proposing)].T
        return result

    def compile(self, shape: tuple[int, int, int], num_rows: int) -> None:
        """Compiles the proposal loop for a step of padded ``shape`` (tokens, sequences, blocks per
        sequence) sampling ``num_rows`` padded rows (`precompile`)."""
        _, s_pad, b_pad = shape
        with jax.set_mesh(self.mesh):
            self._run_proposals(np.zeros(num_rows, np.int32), np.full((s_pad, self.k + 1), -1, np.int32),
                                np.full((s_pad, self.k), -1, np.int32), np.zeros(s_pad, np.int32),
                                np.zeros((s_pad, b_pad), np.int32), 0)

    def _run_proposals(self, sampled, rows, drafts, next_pos, tables, num_proposing: int):
        tokens, self.kv_pool.caches = self.counter.call(
            "draft_propose", self._propose, self.state, self.kv_pool.caches, sampled, rows, drafts, next_pos, tables,
            np.int32(num_proposing), self._greedy(tables.shape[0]), np.int32(self.k if num_proposing else 0),
            num_fixed=2)
        return tokens

    # The jitted functions -------------------------------------------------------------------------
    def _forward(self, state, kv_caches, input_ids, md):
        """The draft's K/V of the step's tokens (its hidden states are not needed)."""
        return nnx.merge(self.graphdef, state)(input_ids, md.positions, kv_caches, md)[1]

    def _logits(self, state, kv_caches, input_ids, md, logits_indices):
        model = nnx.merge(self.graphdef, state)
        hidden, kv_caches = model(input_ids, md.positions, kv_caches, md)
        return model.compute_logits(hidden[logits_indices]), kv_caches

    def _accept_and_propose(self, loop, state, kv_caches, sampled, rows, drafts, next_pos, tables, num_proposing,
                            greedy, num_steps):
        """``num_steps`` greedy draft tokens for each of the first ``num_proposing`` rows, starting
        from the token its step ended with: [k, S] tokens, and the updated KV caches.

        Args:
          sampled: int32 [R]; rows: int32 [S, k + 1]: a row's sample rows by ``spec_index`` (-1: none);
          drafts: int32 [S, k] its verified proposals (-1 padded); next_pos: int32 [S];
          tables: int32 [S, B] the rows' block tables.
        """
        tokens = jnp.where(rows >= 0, sampled[jnp.maximum(rows, 0)], -2)
        accepted = leading_matches(tokens, drafts, jnp)
        last = jnp.take_along_axis(tokens, accepted[:, None], axis=1)[:, 0]  # correction or bonus token
        s, bs = tables.shape[0], self.kv_pool.block_size
        real = jnp.arange(s) < num_proposing
        pos = next_pos + accepted
        block = jnp.take_along_axis(tables, (pos // bs)[:, None], axis=1, mode="clip")[:, 0]
        md = AttentionMetadata(
            slot_mapping=jnp.where(real, block * bs + pos % bs, -1), block_tables=tables,
            seq_lens=jnp.where(real, pos + 1, 0), query_start_loc=jnp.minimum(jnp.arange(s + 1), num_proposing),
            num_seqs=num_proposing, positions=jnp.where(real, pos, 0), decode_only=self.decode_only)
        outs, kv_caches = loop(state, kv_caches, jnp.where(real, last, 0), md, jnp.arange(s), greedy, num_steps)
        return outs[0], kv_caches


def load_draft_model(spec, target_config, *, dtype, attention_backend: str, mesh, max_model_len: int):
    """The draft model of ``spec`` (a `SpeculativeConfig` with ``method="draft_model"``): loaded
    from its path or preset onto ``mesh``, or the NNX model given, checked against the target
    (the same vocabulary, positions for ``max_model_len``) before anything runs."""
    model = spec.model
    if isinstance(model, str):
        from jpaged.loading import presets
        from jpaged.loading.model_loader import load_model

        path, _ = presets.resolve(model, {})
        if path is None:
            from jpaged.loading.gguf_loader import default_model_path
            path = default_model_path()
        model, _, _ = load_model(path, dtype=dtype, mesh=mesh, attention_backend=attention_backend)
    elif not hasattr(model, "config") or not hasattr(model, "compute_logits"):
        raise ValueError(f"speculative_config.model: {type(model).__name__} is neither a path nor a model with "
                         "the jpaged model interface")
    c = model.config
    if c.vocab_size != target_config.vocab_size:
        raise ValueError(f"speculative_config.model: the draft's vocabulary has {c.vocab_size} tokens, the target's "
                         f"{target_config.vocab_size}: a draft must share the target's tokenizer")
    if c.max_position_embeddings < max_model_len:
        raise ValueError(f"speculative_config.model: the draft's max_position_embeddings={c.max_position_embeddings} "
                         f"is below max_model_len={max_model_len}")
    tp = mesh.shape[sharding.MODEL_AXIS]
    if not isinstance(spec.model, str) and sharding.kv_head_replication(c.num_heads, c.num_kv_heads, tp) != 1:
        raise ValueError(f"tensor_parallel_size={tp}: an in-memory draft model with {c.num_kv_heads} KV heads "
                         "cannot be split; give its path")
    return model
