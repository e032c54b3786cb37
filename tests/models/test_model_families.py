"""Qwen3, Mistral with its sliding window, Gemma 2, Gemma 3, Mixtral and Qwen3-MoE from Hugging Face
directories: greedy tokens equal transformers' exactly (float32) through preemption, chunked
prefill and prefix-cache hits; parallel samples and beams; swaps; tensor and expert parallelism;
the pallas backend; configs the engine cannot serve are refused by the config.json field.
Qwen3-Next and Qwen3.5 (linear-attention layers with a recurrent state, `RECURRENT` below) run
without prefix caching: their second pass recomputes (tests/models/test_qwen3_next.py has the rest).

The random checkpoints have perturbed norm weights (Gemma's start at 0, i.e. 1 + 0) and windows
shorter than the prompts, so that the +1 norms, the windows and the soft caps all show.
"""
import json

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import assert_greedy_parity, hf_greedy, random_prompts
from jpaged import LLM, BeamSearchParams, SamplingParams
from jpaged import testing

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=2048, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)
GEMMA = dict(TINY, initializer_range=0.05, head_dim=16, sliding_window=12, query_pre_attn_scalar=20)

# name -> (transformers config class, its arguments)
FAMILIES = {
    "qwen3": ("Qwen3Config", dict(TINY, head_dim=16)),
    "mistral": ("MistralConfig", dict(TINY, sliding_window=12)),
    "gemma2": ("Gemma2Config", dict(GEMMA, attn_logit_softcapping=10.0, final_logit_softcapping=15.0)),
    "gemma3": ("Gemma3TextConfig", dict(GEMMA, layer_types=["sliding_attention", "full_attention"],
                                        rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "mixtral": ("MixtralConfig", dict(TINY, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(TINY, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                          moe_intermediate_size=32, norm_topk_prob=True)),
    # top-4 of 8 experts, a clamp that bites, a window shorter than the prompts, YaRN (its default rope)
    "gpt_oss": ("GptOssConfig", dict(TINY, head_dim=16, intermediate_size=32, num_local_experts=8,
                                     num_experts_per_tok=4, sliding_window=12, swiglu_limit=0.5)),
    # 3 chunked rope layers and a NoPE one, chunks shorter than the prompts, a temperature that bites
    # early, MoE (top-1 of 4, a shared expert) on every other layer
    "llama4": ("Llama4TextConfig", dict(TINY, num_hidden_layers=4, head_dim=16, intermediate_size=32,
                                        intermediate_size_mlp=128, num_local_experts=4, num_experts_per_tok=1,
                                        interleave_moe_layer_step=2, attention_chunk_size=8, floor_scale=4,
                                        attn_scale=0.5)),
    # three gated delta-net layers to one full-attention layer (output gate, partial rope), MoE with a
    # shared expert; value heads served two per key head
    "qwen3_next": ("Qwen3NextConfig", dict(TINY, num_hidden_layers=4, head_dim=16, linear_num_key_heads=2,
                                           linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                                           num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=32)),
    # the same layers with unfused projections and dense MLPs; a full layer first, two linear ones
    "qwen3_5": ("Qwen3_5TextConfig", dict(TINY, num_hidden_layers=3, head_dim=16, linear_num_key_heads=2,
                                          linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=16,
                                          layer_types=["full_attention", "linear_attention", "linear_attention"])),
}
RECURRENT = ("qwen3_next", "qwen3_5")  # families with linear-attention layers: prefix caching is off
PROMPT_LENS = [1, 7, 30, 20]
# One engine shape per family, small enough to preempt (a windowed model needs fewer blocks:
# Mistral's 9 hold what takes 12 without its window): tests that share it share compilations.
# Single steps: a decode window reserves its slots ahead, which in pools this small evicts the
# cached prefixes these tests hit.
ENGINE = dict(block_size=8, max_model_len=256, max_num_batched_tokens=16, num_scheduler_steps=1)
BLOCKS = {"qwen3": 12, "mistral": 9, "gemma2": 22, "gemma3": 22, "mixtral": 12, "qwen3_moe": 12, "gpt_oss": 22,
          "llama4": 12, "qwen3_next": 12, "qwen3_5": 12}
_dirs = {}


def family(tmp_path_factory, name):
    """(checkpoint directory, transformers model) of a family's tiny random model (made once)."""
    if name not in _dirs:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        cls_name, kwargs = FAMILIES[name]
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(getattr(transformers, cls_name)(**kwargs)).eval()
        noise = torch.Generator().manual_seed(1)
        with torch.no_grad():  # norms (and any all-zero weight, e.g. a router) get random values
            for param_name, param in model.named_parameters():
                if "norm" in param_name or not param.abs().sum():
                    param.add_(torch.randn(param.shape, generator=noise) * 0.2)
        path = str(tmp_path_factory.mktemp(name))
        model.save_pretrained(path)
        _dirs[name] = (path, model)
    return _dirs[name]


def engine(tmp_path_factory, name, **kwargs) -> LLM:
    return LLM(family(tmp_path_factory, name)[0], **{**ENGINE, "num_kv_blocks": BLOCKS[name], **kwargs})


# gpt-oss and Llama 4 compile the longest (cold: 40-70 s each on 2 cores): their parity runs with -m slow
PARITY_FAMILIES = [pytest.param(name, marks=pytest.mark.slow) if name in ("gpt_oss", "llama4") else name
                   for name in FAMILIES]


@pytest.mark.parametrize("name", PARITY_FAMILIES)
def test_greedy_parity_with_preemption_and_prefix_hits(tmp_path_factory, name):
    """Chunked prompts in a pool that preempts, then the same prompts again from the prefix cache."""
    hf_model = family(tmp_path_factory, name)[1]
    llm = engine(tmp_path_factory, name)
    prompts = random_prompts(np.random.default_rng(0), PROMPT_LENS)
    assert_greedy_parity(name, hf_model, llm, prompts, max_tokens=16)
    metrics = assert_greedy_parity(name, hf_model, llm, prompts, max_tokens=16)  # again: prefix-cache hits
    assert metrics["num_preemptions"] > 0, "the pool was meant to be small enough to preempt"
    if name in RECURRENT:  # prefix caching is off for them (a state cannot resume from cached blocks)
        assert metrics["prefix_cache_queries"] == 0 and metrics["num_free_state_slots"] == metrics["num_state_slots"]
    else:
        assert metrics["prefix_cache_hits"] > 0
    windows = llm.llm_engine.runner.kv_layout.group_windows
    assert windows == {"mistral": (12,), "gemma2": (None, 12), "gemma3": (None, 12),
                       "gpt_oss": (None, 12)}.get(name, (None,))


@pytest.mark.slow
def test_parallel_samples_beams_and_swaps_share_blocks_in_every_group(tmp_path_factory):
    """Gemma 2 (a global and a windowed group): n = 3 greedy samples equal the single greedy one,
    beams equal transformers' beam search, and seeded samples come out the same whether preemption
    swaps their blocks (released ones stay out) or recomputes them."""
    import torch

    hf_model = family(tmp_path_factory, "gemma2")[1]
    llm = engine(tmp_path_factory, "gemma2")
    prompts = random_prompts(np.random.default_rng(3), [14, 9])
    greedy = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    single = llm.generate(prompts, greedy, use_tqdm=False)
    many = llm.generate(prompts, SamplingParams(n=3, temperature=0, max_tokens=8, min_tokens=8), use_tqdm=False)
    for one, three in zip(single, many):
        assert all(c.token_ids == one.outputs[0].token_ids for c in three.outputs)
    beams = llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True))
    for prompt, result in zip(prompts, beams):
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([prompt]), num_beams=3, num_return_sequences=3, do_sample=False,
                                    max_new_tokens=8, eos_token_id=None, pad_token_id=0)
        assert [s.token_ids for s in result.sequences] == ref[:, len(prompt):].tolist()
    m = llm.get_metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"]
    sampled = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=16, ignore_eos=True)
    runs = {}
    for mode in ("recompute", "swap"):
        run = engine(tmp_path_factory, "gemma2", preemption_mode=mode)
        outs = run.generate(random_prompts(np.random.default_rng(4), [24, 17, 9]), sampled, use_tqdm=False)
        runs[mode] = [[c.token_ids for c in o.outputs] for o in outs]
        m = run.get_metrics()
        assert m["num_preemptions"] > 0 and (m["num_swap_outs"] > 0) == (mode == "swap")
        assert m["num_free_blocks"] == m["num_total_blocks"] and not testing.swap_space(run).swapped
    assert runs["swap"] == runs["recompute"]


def _tokens(llm, prompts, max_tokens=10):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=max_tokens)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma3", "mixtral"])
def test_tensor_parallel_2_equals_transformers(tmp_path_factory, name):
    """Gemma 3 (its KV-cache groups split by heads) and Mixtral (experts split like MLPs)."""
    hf_model = family(tmp_path_factory, name)[1]
    prompts = random_prompts(np.random.default_rng(5), [30, 9, 17])
    llm = engine(tmp_path_factory, name, tensor_parallel_size=2)
    assert _tokens(llm, prompts) == [hf_greedy(hf_model, p, 10)[0] for p in prompts]
    state = testing.model_state(llm)
    if name == "mixtral":
        assert state["layers"][0]["mlp"]["experts"]["gate_proj"][...].sharding.spec == P(None, None, "model")
        assert state["layers"][0]["mlp"]["experts"]["down_proj"][...].sharding.spec == P(None, "model", None)


@pytest.mark.slow
def test_expert_parallel_on_4_devices_equals_one_device(tmp_path_factory):
    """Qwen3-MoE's 4 experts, one whole expert per device (the tokens routed to it run there)."""
    hf_model = family(tmp_path_factory, "qwen3_moe")[1]
    prompts = random_prompts(np.random.default_rng(6), [25, 4, 40])
    one = _tokens(engine(tmp_path_factory, "qwen3_moe"), prompts)
    ep = engine(tmp_path_factory, "qwen3_moe", tensor_parallel_size=4, enable_expert_parallel=True)
    assert _tokens(ep, prompts) == one == [hf_greedy(hf_model, p, 10)[0] for p in prompts]
    gate = testing.model_state(ep)["layers"][0]["mlp"]["experts"]["gate_proj"][...]
    assert gate.sharding.spec == P("model", None, None) and gate.addressable_shards[0].data.shape[0] == 1
    with pytest.raises(ValueError, match="enable_expert_parallel"):
        engine(tmp_path_factory, "qwen3", enable_expert_parallel=True)


@pytest.mark.slow  # Pallas interpret mode: a minute or more each (in .ci/run's slow part)
def test_pallas_backend_matches_xla(tmp_path_factory):
    """Qwen3 on the Pallas kernels (interpret mode here): a short case."""
    prompts = random_prompts(np.random.default_rng(7), [12, 3])
    pallas = _tokens(engine(tmp_path_factory, "qwen3", attention_backend="pallas"), prompts, 4)
    assert pallas == _tokens(engine(tmp_path_factory, "qwen3"), prompts, 4)


@pytest.mark.slow
def test_pallas_backend_with_windows_and_soft_caps(tmp_path_factory):
    """Gemma 2 on the Pallas kernels: windowed and global layers, both soft caps."""
    hf_model = family(tmp_path_factory, "gemma2")[1]
    prompts = random_prompts(np.random.default_rng(8), [20, 3])
    llm = engine(tmp_path_factory, "gemma2", attention_backend="pallas")
    assert _tokens(llm, prompts, 4) == [hf_greedy(hf_model, p, 4)[0] for p in prompts]


@pytest.mark.parametrize("change, field", [
    (dict(architectures=["FalconForCausalLM"]), "architectures"),
    (dict(attn_logit_softcapping=30.0), "attn_logit_softcapping"),
    (dict(final_logit_softcapping=30.0), "final_logit_softcapping"),
    (dict(layer_types=["chunked_attention", "full_attention"]), "layer_types"),
    (dict(layer_types=["sliding_attention", "full_attention"], sliding_window=0), "sliding_window"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling"),
    (dict(rope_local_base_freq=10000.0), "rope_local_base_freq"),
])
def test_configs_it_cannot_serve_are_refused_before_any_weight(tmp_path, change, field):
    """A config.json alone (no weights): the field is named, nothing is loaded."""
    from jpaged.loading import load_model

    cfg = dict(dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=64, hidden_size=32,
                    intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2), **change)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=field):
        load_model(str(tmp_path), dtype=np.float32, attention_backend="xla")


@pytest.mark.parametrize("cfg, field", [
    (dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", use_bidirectional_attention=True),
     "use_bidirectional_attention"),
    (dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
          rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                           "sliding_attention": {"rope_type": "linear", "factor": 2.0}}), "rope_parameters"),
    (dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
          moe_intermediate_size=16, shared_expert_intermediate_size=32), "shared_expert_intermediate_size"),
    (dict(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=2, num_experts_per_tok=4),
     "num_experts_per_tok"),
])
def test_model_specific_fields_are_checked_before_any_weight(tmp_path, cfg, field):
    from jpaged.loading import load_model

    cfg = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, **cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=field):
        load_model(str(tmp_path), dtype=np.float32, attention_backend="xla")


@pytest.mark.parametrize("name", ["gemma2", "mistral"])
def test_prompt_lookup_with_sliding_windows(tmp_path_factory, name):
    """Speculation over KV-cache groups (Gemma 2) and a window that releases blocks (Mistral):
    verification steps carry every group's table, and rejected proposals' blocks go back in
    every group. Greedy tokens equal transformers'; every block is free afterwards."""
    hf_model = family(tmp_path_factory, name)[1]
    rng = np.random.default_rng(9)
    prompts = [list(p) * 3 for p in random_prompts(rng, [6, 9])]  # repeats: prompt lookup finds them
    llm = engine(tmp_path_factory, name, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert _tokens(llm, prompts, 12) == [hf_greedy(hf_model, p, 12)[0] for p in prompts]
    m = llm.get_metrics()
    assert m["spec_decode_num_draft_tokens"] > 0 and m["num_free_blocks"] == m["num_total_blocks"]
