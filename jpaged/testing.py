"""Test hooks: the documented ways a test reaches past the public API into a running engine.

Tests read internal state through these functions only, so that when the engine's insides move,
this file changes and the tests do not. Each takes an `LLM` (or anything with ``llm_engine``) or
an `LLMEngine` itself.
"""


def engine_of(llm_or_engine):
    """The `LLMEngine` behind an `LLM`, or the engine itself."""
    return getattr(llm_or_engine, "llm_engine", llm_or_engine)


def model_state(llm_or_engine):
    """The served model's parameters as the runner holds them (an ``nnx.State``, placed on the mesh)."""
    return engine_of(llm_or_engine).runner.state


def device_kv(llm_or_engine):
    """The KV arrays on the device (`jpaged.runner.kv_pool.KVPool`: ``caches`` holds one tuple of
    ``(k_pages, v_pages[, kv_scales])`` per pool tensor)."""
    return engine_of(llm_or_engine).runner.kv_pool


def block_pool(llm_or_engine):
    """The accounting of which KV block holds what (`jpaged.core.block_pool.BlockPool` or a
    baseline's pool: ``num_free_blocks``, ``check_invariants()``)."""
    return engine_of(llm_or_engine).kv_cache.pool


def swap_space(llm_or_engine):
    """The host blocks of swapped-out requests (`jpaged.core.swap_space.SwapSpace`: ``swapped``,
    ``num_used_blocks``)."""
    return engine_of(llm_or_engine).scheduler.swap_space


def state_slots(llm_or_engine):
    """The recurrent-state slots of a model with recurrent layers
    (`jpaged.core.recurrent_state.RecurrentStateCache`: ``slots``, ``num_free_slots``), else None."""
    return engine_of(llm_or_engine).scheduler.recurrent_state
