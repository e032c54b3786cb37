"""Default settings serve a default request: an unset ``max_model_len`` is capped to what the KV pool
holds for one sequence (logged once), a set one larger than a byte-budget pool holds is refused at
start naming both numbers, and a request too long for the pool is refused naming what to set and by
how much (``max_tokens``, the pool's ``num_kv_blocks`` / ``kv_cache_memory_bytes``)."""

import pytest

from conftest import JpagedLog
from jpaged import LLM, SamplingParams
from jpaged.core.kv_cache_layout import kv_cache_layout


def assert_all_free(llm):
    m = llm.get_metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"], m


def test_max_tokens_per_seq_inverts_max_blocks_per_seq():
    """A global and a windowed group (window 12): 20 tokens take 5 + 5 of 10 blocks, 21 take 12."""
    layout = kv_cache_layout([None, 12])
    assert layout.max_tokens_per_seq(10, 4, 8, limit=1000) == 20
    assert layout.max_blocks_per_seq(20, 4, 8) <= 10 < layout.max_blocks_per_seq(21, 4, 8)
    assert layout.max_tokens_per_seq(10, 4, 8, limit=17) == 17
    windowed = kv_cache_layout([12])  # a window's blocks stop growing: any length fits 6 blocks
    assert windowed.max_tokens_per_seq(6, 4, 8, limit=4096) == 4096
    assert kv_cache_layout([None]).max_tokens_per_seq(1, 16, 8, limit=100) == 16


def test_unset_max_model_len_is_capped_to_the_pool(llama_dir):
    """The model's 2048 positions, a pool of 4 blocks of 8: max_model_len 32, and a request without
    max_tokens (up to max_model_len) runs to it instead of being refused."""
    with JpagedLog() as log:
        llm = LLM(llama_dir[0], num_kv_blocks=4, block_size=8)
    assert llm.llm_engine.max_model_len == 32
    assert ("max_model_len capped from 2048 to 32: the KV pool holds 4 blocks of 8 tokens; "
            "set kv_cache_memory_bytes/num_kv_blocks to raise it") in log.messages
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 29 and out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match=r"prompt: 40 tokens, but max_model_len=32 \(capped from the model's "
                                         r"2048 .*num_kv_blocks/kv_cache_memory_bytes"):
        llm.generate([[5] * 40], SamplingParams(max_tokens=1), use_tqdm=False)
    assert_all_free(llm)


def test_explicit_max_model_len_over_a_byte_budget_raises_at_start(llama_dir):
    """2 layers x 2 KV heads x 16 head_dim x float32 x K and V: 512 bytes a token, 8 KiB a block of 16."""
    with pytest.raises(ValueError, match=r"max_model_len=1024: one sequence of it needs 64 KV blocks of 16 tokens "
                                         r"\(524288 bytes\), but the pool \(kv_cache_memory_bytes\) holds 8 "
                                         r"\(65536 bytes\); lower max_model_len to <= 128 or set "
                                         r"kv_cache_memory_bytes >= 524288"):
        LLM(llama_dir[0], kv_cache_memory_bytes=8 * 8192, max_model_len=1024)


def test_too_long_request_names_what_to_set_and_engine_keeps_serving(llama_dir):
    """A pool set with num_kv_blocks stays as given; the request that does not fit is refused with
    max_tokens (the server's param) and the numbers to change, and the next request runs."""
    from jpaged.entrypoints.openai_server import bad_request

    llm = LLM(llama_dir[0], num_kv_blocks=4, block_size=8, max_model_len=64)
    assert llm.llm_engine.max_model_len == 64
    with pytest.raises(ValueError) as unset:
        llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=None), use_tqdm=False)
    message = str(unset.value)
    assert "max_tokens=None (up to max_model_len=64)" in message
    assert "need 8 KV blocks of 8 tokens, 4 more than the pool's 4" in message
    assert "set max_tokens <= 28" in message and "num_kv_blocks >= 8 (kv_cache_memory_bytes >= " in message
    assert bad_request(unset.value).param == "max_tokens"
    with pytest.raises(ValueError, match=r"max_tokens=20: this request's 2 sequence\(s\) of up to 24 tokens .* "
                                         r"set max_tokens <= 12, lower n, or start the engine with num_kv_blocks >= 6"):
        llm.generate([[5, 6, 7, 8]], SamplingParams(n=2, max_tokens=20), use_tqdm=False)
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=28, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 28
    assert_all_free(llm)


def test_windowed_model_is_not_capped_by_blocks_its_window_never_holds(tmp_path_factory):
    """Mistral with a 12-token window and steps of at most 8 tokens holds 6 blocks of 4 at any length:
    6 blocks serve its whole 2048 positions."""
    from conftest import _save
    from transformers import MistralConfig

    path, _ = _save(tmp_path_factory, "mistral_window", MistralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, max_position_embeddings=2048, initializer_range=0.1, sliding_window=12,
        bos_token_id=1, eos_token_id=2, pad_token_id=0))
    llm = LLM(path, num_kv_blocks=6, block_size=4, max_num_batched_tokens=8, max_num_seqs=1)
    assert llm.llm_engine.max_model_len == 2048
    out = llm.generate([[5] * 20], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 30
    assert_all_free(llm)


def test_default_model_serves_a_request_without_max_tokens():
    """`LLM()` on the CPU defaults (256 MiB pool: 364 blocks of 16 for SmolLM2) caps its 8192
    positions to 5824, so the default request (max_tokens=None) is accepted and runs."""
    pytest.importorskip("gguf")
    try:
        from jpaged.loading.gguf_loader import default_model_path
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    llm = LLM()
    engine = llm.llm_engine
    blocks = engine.num_blocks
    assert engine.max_model_len == min(8192, blocks * 16) and engine.max_model_len < 8192, (blocks,)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=None), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop" and "Paris" in out.outputs[0].text
    assert_all_free(llm)
