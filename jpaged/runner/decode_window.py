"""A decode window: up to N decode steps in one jitted loop, each step's sampled tokens fed to the
next on the device (positions, slots and context lengths advance there), so the host prepares once
and reads every step's tokens at the end (`Scheduler._plan_decode_window` decides when)."""
import dataclasses

import jax
import jax.numpy as jnp

from jpaged.sample.sampler import sample


def next_decode_step(md, tokens, block_size: int):
    """A decode-only step's successor: each sequence's sampled token becomes its input at the next
    position (token ``i`` of a decode-only step is sequence ``i``'s), written through each KV-cache
    group's table."""
    real = md.slot_mapping >= 0
    positions = md.positions + 1

    def slots(block_tables):
        blocks = jnp.take_along_axis(block_tables, (positions // block_size)[:, None], axis=1, mode="clip")[:, 0]
        return jnp.where(real, blocks * block_size + positions % block_size, -1)

    group_slots = None if md.group_block_tables is None else jax.vmap(slots)(md.group_block_tables)
    md = dataclasses.replace(md, positions=jnp.where(real, positions, 0), slot_mapping=slots(md.block_tables),
                             seq_lens=jnp.where(md.seq_lens > 0, md.seq_lens + 1, 0), group_slot_mappings=group_slots)
    return jnp.where(real, tokens[:real.shape[0]], 0), md


def decode_window(logits_fn, params, kv_caches, input_ids, md, logits_indices, sampling, num_steps, *,
                  max_steps: int, block_size: int, vocab_size: int):
    """Up to ``max_steps`` decode steps in a loop of ``num_steps`` (a run-time count).

    Args:
      logits_fn: ``(params, kv_caches, input_ids, md, logits_indices) -> (logits [R, V], kv_caches)``,
        one whole forward.
      sampling: the rows' `SamplingTensors`; a row's banned tokens (EOS and stop tokens) stay
        banned until it has ``sampling.min_tokens`` output tokens.

    Returns:
      The sampled tokens, logprobs, top ids and top logprobs of every step, each
      ``[max_steps, R, ...]``, and the updated KV caches.
    """
    def step(i, carry):
        kv_caches, input_ids, md, outs = carry
        logits, kv_caches = logits_fn(params, kv_caches, input_ids, md, logits_indices)
        steps = sampling.steps + i  # each row's output tokens so far: its draw's key, its bans
        banned = jnp.where((steps < sampling.min_tokens)[:, None], sampling.banned_token_ids, -1)
        sampled = sample(logits, dataclasses.replace(sampling, steps=steps, banned_token_ids=banned))
        outs = tuple(o.at[i].set(x) for o, x in zip(outs, sampled))
        input_ids, md = next_decode_step(md, sampled[0], block_size)
        return kv_caches, input_ids, md, outs

    shapes = jax.eval_shape(sample, jax.ShapeDtypeStruct((logits_indices.shape[0], vocab_size), jnp.float32),
                            sampling)
    outs = tuple(jnp.zeros((max_steps,) + x.shape, x.dtype) for x in shapes)
    kv_caches, _, _, outs = jax.lax.fori_loop(0, num_steps, step, (kv_caches, input_ids, md, outs))
    return outs, kv_caches
