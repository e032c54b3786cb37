"""DeepSeek-V3 and V2 (multi-head latent attention, latent paged KV cache, shared experts, grouped
routing) from Hugging Face directories: greedy tokens equal transformers' exactly (float32) through
preemption, chunked prefill, prefix-cache hits, parallel samples; the latent pool's size; the MLA
kernels against a dense numpy oracle; configs the engine cannot serve are refused by field.

The random checkpoints have perturbed norms and a random ``e_score_correction_bias`` (a buffer,
zero at init), so the latent norms and the biased group routing all show.
"""
import json

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_greedy_parity, random_prompts
from jpaged import LLM, SamplingParams
from pallas_kernels import paged_mla

MLA = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
           kv_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, vocab_size=256,
           max_position_embeddings=2048, initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0,
           n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1)
FAMILIES = {
    # V3: low-rank q, noaux_tc over 4 groups (top 2), a shared expert, YaRN with its mscale
    "deepseek_v3": ("DeepseekV3Config", dict(MLA, q_lora_rank=32, n_group=4, topk_group=2, n_shared_experts=1,
                                             norm_topk_prob=True, routed_scaling_factor=2.5,
                                             rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32,
                                                           "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                                                           "original_max_position_embeddings": 512})),
    # V2-Lite: no q_lora_rank, softmax greedy routing, two shared experts
    "deepseek_v2": ("DeepseekV2Config", dict(MLA, q_lora_rank=None, n_shared_experts=2, topk_method="greedy")),
    # V2: group-limited greedy routing
    "deepseek_v2_grouped": ("DeepseekV2Config", dict(MLA, q_lora_rank=16, n_shared_experts=1, n_group=2, topk_group=1,
                                                     topk_method="group_limited_greedy", routed_scaling_factor=1.5)),
}
PROMPT_LENS = [1, 7, 30, 20]
ENGINE = dict(block_size=8, max_model_len=256, max_num_batched_tokens=16, num_kv_blocks=12)
_dirs = {}


def family(tmp_path_factory, name):
    """(checkpoint directory, transformers model) of a tiny random DeepSeek (made once)."""
    if name not in _dirs:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        cls_name, kwargs = FAMILIES[name]
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(getattr(transformers, cls_name)(**kwargs)).eval()
        noise = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for param_name, param in list(model.named_parameters()) + list(model.named_buffers()):
                if "norm" in param_name or "correction_bias" in param_name:
                    param.add_(torch.randn(param.shape, generator=noise) * 0.2)
        path = str(tmp_path_factory.mktemp(name))
        model.save_pretrained(path)
        _dirs[name] = (path, model)
    return _dirs[name]


def engine(tmp_path_factory, name, **kwargs) -> LLM:
    return LLM(family(tmp_path_factory, name)[0], **{**ENGINE, **kwargs})


@pytest.mark.parametrize("name", ["deepseek_v3", pytest.param("deepseek_v2", marks=pytest.mark.slow),
                                  pytest.param("deepseek_v2_grouped", marks=pytest.mark.slow)])
def test_greedy_parity_with_preemption_and_prefix_hits(tmp_path_factory, name):
    """Chunked prompts in a pool that preempts, then the same prompts again from the prefix cache."""
    hf_model = family(tmp_path_factory, name)[1]
    llm = engine(tmp_path_factory, name)
    prompts = random_prompts(np.random.default_rng(0), PROMPT_LENS)
    assert_greedy_parity(name, hf_model, llm, prompts, max_tokens=16)
    metrics = assert_greedy_parity(name, hf_model, llm, prompts, max_tokens=16)  # again: prefix-cache hits
    assert metrics["num_preemptions"] > 0, "the pool was meant to be small enough to preempt"
    assert metrics["prefix_cache_hits"] > 0


def test_latent_pool_holds_one_row_per_token(tmp_path_factory):
    """Each layer's pool is the K and V halves of one kv_lora_rank + qk_rope_head_dim row: 32 values
    per token and layer here, against 2 * 4 heads * 24 = 192 for the expanded K/V."""
    llm = engine(tmp_path_factory, "deepseek_v3")
    caches = llm.llm_engine.runner.kv_pool.caches
    assert len(caches) == MLA["num_hidden_layers"]
    for k_pages, v_pages in caches:
        assert k_pages.shape == v_pages.shape == (1, ENGINE["num_kv_blocks"], ENGINE["block_size"], 16)


@pytest.mark.slow  # about 2 minutes on a loaded 2-core CPU
def test_parallel_samples_share_latent_blocks_copy_on_write(tmp_path_factory):
    """n > 1 forks share the prompt's latent blocks (copy-on-write on the partial last block): greedy
    forks all equal transformers' tokens, and every block is free afterwards."""
    from conftest import hf_greedy

    path, hf_model = family(tmp_path_factory, "deepseek_v3")
    llm = LLM(path, block_size=8, max_model_len=256, max_num_batched_tokens=32, num_kv_blocks=24)
    prompt = random_prompts(np.random.default_rng(3), [13])[0]
    out = llm.generate([prompt], SamplingParams(n=3, temperature=0.0, max_tokens=10, min_tokens=10),
                       use_tqdm=False)[0]
    expected = hf_greedy(hf_model, prompt, 10)[0]
    assert [o.token_ids for o in out.outputs] == [expected] * 3
    sampled = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10), use_tqdm=False)[0]
    assert len(sampled.outputs) == 3
    metrics = llm.get_metrics()
    assert metrics["num_free_blocks"] == metrics["num_total_blocks"]


def _latent_oracle(q, rows, kv_lora_rank, scale, seq_of_token, pos_of_token):
    """Dense numpy MLA: token t attends rows[seq, 0..pos] of its sequence."""
    out = np.zeros(q.shape[:2] + (kv_lora_rank,), np.float32)
    for t, (s, p) in enumerate(zip(seq_of_token, pos_of_token)):
        if s < 0:
            continue
        r = rows[s][:p + 1]                                     # [K, W]
        logits = q[t] @ r.T * scale                             # [H, K]
        w = np.exp(logits - logits.max(-1, keepdims=True))
        out[t] = (w / w.sum(-1, keepdims=True)) @ r[:, :kv_lora_rank]
    return out


def _pool_with(rows_per_seq, block_size, num_blocks, width, rng):
    """A latent pool holding each sequence's rows in shuffled blocks; (k_pages, v_pages, tables)."""
    pool = rng.standard_normal((num_blocks, block_size, width)).astype(np.float32)
    ids = rng.permutation(num_blocks)
    max_blocks = max(-(-len(r) // block_size) for r in rows_per_seq)
    tables = np.zeros((len(rows_per_seq), max_blocks), np.int32)
    used = 0
    for s, rows in enumerate(rows_per_seq):
        n = -(-len(rows) // block_size)
        tables[s, :n] = ids[used:used + n]
        used += n
        for i, row in enumerate(rows):
            pool[tables[s, i // block_size], i % block_size] = row
    half = width // 2
    return jnp.asarray(pool[None, ..., :half]), jnp.asarray(pool[None, ..., half:]), jnp.asarray(tables)


def test_mla_kernels_match_a_dense_oracle():
    """The jnp ragged kernel (prefill chunks and decode rows in one batch, padding) and the Pallas
    decode kernel (interpret mode) equal dense softmax attention over the latent rows."""
    rng = np.random.default_rng(0)
    r, width, heads, bs = 24, 32, 4, 8
    ctx = [13, 1, 40]
    rows = [rng.standard_normal((n, width)).astype(np.float32) for n in ctx]
    k_pages, v_pages, tables = _pool_with(rows, bs, 16, width, rng)
    # sequence 0: a 5-token chunk ending at 13; 1: a decode row; 2: a decode row; then 2 padding tokens
    q_lens = [5, 1, 1]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    seq_of = [0] * 5 + [1, 2, -1, -1]
    pos_of = [8, 9, 10, 11, 12, 0, 39, 0, 0]
    q = rng.standard_normal((len(seq_of), heads, width)).astype(np.float32)
    seq_lens = np.array(ctx + [0], np.int32)
    tables4 = jnp.concatenate([tables, jnp.zeros((1, tables.shape[1]), jnp.int32)])
    qsl4 = np.concatenate([qsl, [qsl[-1]]]).astype(np.int32)
    got = paged_mla.mla_paged_attention_reference(jnp.asarray(q), k_pages, v_pages, tables4, seq_lens, qsl4,
                                                  np.int32(3), kv_lora_rank=r, scale=0.3,
                                                  pages_per_compute_block=2)
    want = _latent_oracle(q, rows, r, 0.3, seq_of, pos_of)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)

    dq = jnp.asarray(q[[4, 5, 6, 7]])  # one query per sequence (the last row of each), then padding
    lens = jnp.asarray(seq_lens)
    want_decode = _latent_oracle(np.asarray(dq), rows, r, 0.3, [0, 1, 2, -1], [12, 0, 39, 0])
    for backend in ("tpu", "gpu", "xla"):
        got = paged_mla.mla_paged_decode(dq, k_pages, v_pages, tables4, lens, kv_lora_rank=r, scale=0.3,
                                         pages_per_compute_block=2, backend=backend, interpret=True)
        np.testing.assert_allclose(np.asarray(got), want_decode, atol=2e-5, err_msg=backend)


@pytest.mark.slow  # Pallas interpret mode through the engine
def test_pallas_backend_equals_transformers(tmp_path_factory):
    hf_model = family(tmp_path_factory, "deepseek_v3")[1]
    llm = engine(tmp_path_factory, "deepseek_v3", attention_backend="pallas")
    prompts = random_prompts(np.random.default_rng(1), [9, 17])
    assert_greedy_parity("deepseek_v3", hf_model, llm, prompts, max_tokens=8)


@pytest.mark.slow
def test_tensor_parallel_2_equals_transformers(tmp_path_factory):
    """Heads split over 2 devices (tests/conftest.py makes 8 CPU devices), each with a replica of
    the latent pool; routed experts split like MLPs."""
    hf_model = family(tmp_path_factory, "deepseek_v3")[1]
    llm = engine(tmp_path_factory, "deepseek_v3", tensor_parallel_size=2)
    prompts = random_prompts(np.random.default_rng(2), [9, 17])
    assert_greedy_parity("deepseek_v3", hf_model, llm, prompts, max_tokens=8)


@pytest.mark.parametrize("change, field", [
    ({"topk_method": "noaux_tc"}, "topk_method"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"scoring_func": "sigmoid"}, "scoring_func"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_scaling"),
    ({"kv_lora_rank": 23}, "kv_lora_rank"),
    ({"n_group": 3, "topk_group": 1, "topk_method": "group_limited_greedy"}, "n_group"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
])
def test_unsupported_variants_are_refused_before_any_weight(tmp_path, change, field):
    """A DeepSeek-V2 config.json with a feature jpaged does not implement: a ValueError naming the
    field, from a directory with no weights at all (none is read)."""
    cfg = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", **MLA,
           "q_lora_rank": None, "n_shared_experts": 1, "topk_method": "greedy"}
    cfg.update(change)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=field):
        LLM(str(tmp_path), **ENGINE)


@pytest.mark.slow
def test_benchmark_script_runs():
    """scripts/benchmark_mla.py on a small layer: both variants, their outputs equal."""
    from run_script import run_script

    result = run_script("benchmark_mla.py", "--contexts=64", "--batch=1", "--heads=2", "--kv_lora_rank=32",
                        "--rope_dim=16", "--nope_dim=16", "--v_dim=16", "--runs=1")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split() for line in result.stdout.splitlines() if line.strip().startswith("64 ")]
    assert [r[1] for r in rows] == ["mla", "expanded", "ratio"]
    assert float(rows[0][-1]) < 1e-4 and "DeepSeek-V3 671B, MLA latent" in result.stdout
