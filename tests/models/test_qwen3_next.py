"""Qwen3-Next and Qwen3.5 text beside the model-family harness (tests/models/test_model_families.py
runs their greedy parity through preemption and chunked prefill, prefix caching off): the gated
delta rule and the causal convolution against transformers' own functions on ragged batches that
continue a state; forks (n > 1, beams) that share the prompt's state and copy it on write, through
preemption; decode windows; the settings these models refuse or change (with their log lines);
configs refused by the config.json field before any weight; TP 2 and the pallas backend (slow)."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import JpagedLog, hf_greedy, random_prompts
from jpaged import LLM, BeamSearchParams, SamplingParams
from jpaged import testing
from test_model_families import engine, family


def _ragged(rng, lengths, width):
    """query_start_loc of sequences of these lengths, and random rows for their tokens."""
    qsl = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return qsl, rng.standard_normal((int(qsl[-1]), width)).astype(np.float32)


def test_causal_conv_continues_each_sequence_state():
    """Ragged sequences (one token, fewer tokens than taps, several chunks' worth) from random conv
    states equal transformers' convolution of [state, tokens]; the new state is the last inputs."""
    import torch
    import torch.nn.functional as F
    from jpaged.models.gated_delta_net import causal_conv

    rng = np.random.default_rng(0)
    lengths, channels, taps = [1, 2, 7, 0], 6, 4
    qsl, x = _ragged(rng, lengths, channels)
    state = rng.standard_normal((len(lengths), taps - 1, channels)).astype(np.float32)
    weight = rng.standard_normal((channels, taps)).astype(np.float32)
    out, new_state = jax.jit(causal_conv)(x, state, weight, qsl)
    for s, n in enumerate(lengths):
        inputs = torch.tensor(np.concatenate([state[s], x[qsl[s]:qsl[s + 1]]]).T[None])  # [1, C, K - 1 + n]
        np.testing.assert_array_equal(np.asarray(new_state)[s], inputs[0].T.numpy()[-(taps - 1):])
        if n:
            ref = F.conv1d(inputs, torch.tensor(weight)[:, None], groups=channels)[0].T.numpy()  # [n, C]
            np.testing.assert_allclose(np.asarray(out)[qsl[s]:qsl[s + 1]], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lengths", [[1, 5, 70, 3], [1, 0, 1, 1]], ids=["prefill", "decode"])
def test_gated_delta_rule_equals_transformers_chunked_form(lengths):
    """Each ragged sequence from a random state equals transformers' chunked gated delta rule (its
    prefill) with that initial state: outputs and final state; a padding row's state is kept."""
    import torch
    from jpaged.models.gated_delta_net import gated_delta_rule, l2_normalize
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    rng = np.random.default_rng(1)
    heads, dk, dv = 2, 4, 3
    qsl = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    t = int(qsl[-1])
    q, k = rng.standard_normal((2, t, heads, dk)).astype(np.float32)
    v = rng.standard_normal((t, heads, dv)).astype(np.float32)
    g = -rng.uniform(0.01, 1.0, (t, heads)).astype(np.float32)
    beta = rng.uniform(0, 1, (t, heads)).astype(np.float32)
    state = rng.standard_normal((len(lengths), heads, dk, dv)).astype(np.float32)
    qn, kn = np.asarray(l2_normalize(jnp.asarray(q))) * dk ** -0.5, np.asarray(l2_normalize(jnp.asarray(k)))
    out, new_state = jax.jit(gated_delta_rule)(qn, kn, v, g, beta, state, qsl)
    for s in range(len(lengths)):
        part = slice(qsl[s], qsl[s + 1])
        if not lengths[s]:
            np.testing.assert_array_equal(np.asarray(new_state)[s], state[s])
            continue
        ref, ref_state = torch_chunk_gated_delta_rule(
            *(torch.tensor(a[part])[None] for a in (q, k, v, g, beta)), initial_state=torch.tensor(state[s:s + 1]),
            output_final_state=True, use_qk_l2norm_in_kernel=True)
        np.testing.assert_allclose(np.asarray(out)[part], ref[0].numpy(), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.asarray(new_state)[s], ref_state[0].numpy(), rtol=1e-4, atol=1e-4)


_engines = {}


def roomy(tmp_path_factory, name):
    """An engine of the family's shape with a pool that never preempts (made once per family)."""
    if name not in _engines:
        _engines[name] = engine(tmp_path_factory, name, num_kv_blocks=64)
    return _engines[name]


def _greedy(llm, prompts, n=1, max_tokens=8):
    params = SamplingParams(n=n, temperature=0, max_tokens=max_tokens, min_tokens=max_tokens)
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


def _all_free(llm):
    m = llm.get_metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"], "blocks leaked"
    assert m["num_free_state_slots"] == m["num_state_slots"], "state slots leaked"
    assert not testing.state_slots(llm).slots and not testing.state_slots(llm).pending_copies


def test_parallel_samples_share_the_prompt_state(tmp_path_factory):
    """n = 3 greedy samples fork from the prompt's state (one slot, copied on the first write of
    each) and all equal transformers' greedy tokens; afterwards every block and slot is free."""
    hf_model = family(tmp_path_factory, "qwen3_next")[1]
    llm = roomy(tmp_path_factory, "qwen3_next")
    prompts = random_prompts(np.random.default_rng(3), [14, 9])
    for prompt, samples in zip(prompts, _greedy(llm, prompts, n=3)):
        assert samples == [hf_greedy(hf_model, prompt, 8)[0]] * 3
    _all_free(llm)


@pytest.mark.slow  # transformers' beam search over its reference linear attention: a minute
def test_beams_equal_transformers_beam_search(tmp_path_factory):
    """Beams fork and drop every step (slots shared, copied on write, freed)."""
    import torch

    hf_model = family(tmp_path_factory, "qwen3_next")[1]
    llm = roomy(tmp_path_factory, "qwen3_next")
    prompts = random_prompts(np.random.default_rng(3), [14, 9])
    beams = llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))
    for prompt, result in zip(prompts, beams):
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([prompt]), num_beams=3, num_return_sequences=3, do_sample=False,
                                    max_new_tokens=6, eos_token_id=None, pad_token_id=0)
        assert [s.token_ids for s in result.sequences] == ref[:, len(prompt):].tolist()
    _all_free(llm)


def test_forked_samples_through_preemption_and_few_state_slots(tmp_path_factory):
    """Seeded n = 2 samples come out the same in a pool that preempts them (their states are
    recomputed) and with two state slots (max_num_seqs=2: a fork's copy waits for a free slot) as
    in a roomy engine; preemption_mode='swap' recomputes instead, saying so."""
    prompts = random_prompts(np.random.default_rng(4), [24, 9, 5])
    params = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=8, ignore_eos=True)
    want = [[c.token_ids for c in o.outputs]
            for o in roomy(tmp_path_factory, "qwen3_next").generate(prompts, params, use_tqdm=False)]
    with JpagedLog() as log:
        tight = engine(tmp_path_factory, "qwen3_next", preemption_mode="swap", max_num_seqs=2)
    assert any("recurrent states are not swapped" in m for m in log.messages)
    got = [[c.token_ids for c in o.outputs] for o in tight.generate(prompts, params, use_tqdm=False)]
    assert got == want
    m = tight.get_metrics()
    assert m["num_preemptions"] > 0 and m["num_swap_outs"] == 0 and m["num_state_slots"] == 2
    _all_free(tight)


def test_decode_windows_carry_the_state(tmp_path_factory):
    """Four decode steps per window on the device: each step continues the state the last wrote."""
    hf_model = family(tmp_path_factory, "qwen3_5")[1]
    prompts = random_prompts(np.random.default_rng(5), [11, 3])
    llm = engine(tmp_path_factory, "qwen3_5", num_kv_blocks=64, num_scheduler_steps=4)
    assert [t[0] for t in _greedy(llm, prompts, max_tokens=9)] == [hf_greedy(hf_model, p, 9)[0] for p in prompts]
    _all_free(llm)


def test_settings_a_recurrent_model_refuses_or_changes(tmp_path_factory):
    """Prefix caching is turned off with a log line; speculative decoding and prefix-cache tiers
    are refused by name."""
    path = family(tmp_path_factory, "qwen3_5")[0]
    with pytest.raises(ValueError, match="speculative_config"):
        LLM(path, num_kv_blocks=16, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="kv_offload"):
        LLM(path, num_kv_blocks=16, kv_offload={"host_bytes": 1 << 20})
    with JpagedLog() as log:
        _engines["qwen3_5"] = llm = engine(tmp_path_factory, "qwen3_5", num_kv_blocks=64)
    assert any("prefix caching is off for this model" in m for m in log.messages)
    prompt = random_prompts(np.random.default_rng(6), [20])
    assert _greedy(llm, prompt * 2) == _greedy(llm, prompt)[0:1] * 2  # the same prompt again: recomputed
    assert llm.get_metrics()["prefix_cache_hits"] == 0


BASE = dict(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", vocab_size=64, hidden_size=32,
            intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
            partial_rotary_factor=0.25)


@pytest.mark.parametrize("change, field", [
    (dict(layer_types=["linear_attention", "sliding_attention"] * 2, sliding_window=4), "layer_types"),
    (dict(layer_types=["linear_attention"] * 4), "layer_types"),
    (dict(layer_types=["linear_attention", "full_attention"]), "layer_types"),
    (dict(linear_num_value_heads=3), "linear_num_value_heads"),
    (dict(linear_conv_kernel_dim=0), "linear_conv_kernel_dim"),
    (dict(partial_rotary_factor=0.375), "partial_rotary_factor"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}), "rope_scaling"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok"),
    (dict(architectures=["LlamaForCausalLM"], model_type="llama", layer_types=["linear_attention"] * 4),
     "layer_types"),
])
def test_configs_it_cannot_serve_are_refused_before_any_weight(tmp_path, change, field):
    """A config.json alone (no weights): the field is named, nothing is loaded."""
    from jpaged.loading import load_model

    (tmp_path / "config.json").write_text(json.dumps(dict(BASE, **change)))
    with pytest.raises(ValueError, match=field):
        load_model(str(tmp_path), dtype=np.float32, attention_backend="xla")


@pytest.mark.slow
def test_tensor_parallel_2_equals_transformers(tmp_path_factory):
    """Heads split over 2 devices: the full layers' KV pool and the recurrent states on their heads."""
    from jax.sharding import PartitionSpec as P

    hf_model = family(tmp_path_factory, "qwen3_next")[1]
    prompts = random_prompts(np.random.default_rng(7), [30, 9, 17])
    llm = engine(tmp_path_factory, "qwen3_next", tensor_parallel_size=2)
    assert [t[0] for t in _greedy(llm, prompts, max_tokens=10)] == [hf_greedy(hf_model, p, 10)[0] for p in prompts]
    pools = testing.device_kv(llm).caches
    assert pools[-1][1].sharding.spec == P(None, "model", None, None)  # [slots, v heads, Dk, Dv]
    _all_free(llm)


@pytest.mark.slow  # Pallas interpret mode for the full-attention layer
def test_pallas_backend_in_one_whole_step_equals_transformers(tmp_path_factory, monkeypatch):
    """The TPU/GPU path: the Pallas kernels (interpret mode here) in one jitted step of the whole
    model (the CPU's layer pieces off)."""
    from jpaged.runner import model_runner

    monkeypatch.setattr(model_runner.LayerPieces, "of", classmethod(lambda cls, model: None))
    hf_model = family(tmp_path_factory, "qwen3_5")[1]
    prompts = random_prompts(np.random.default_rng(8), [20, 3])
    llm = engine(tmp_path_factory, "qwen3_5", attention_backend="pallas")
    assert llm.llm_engine.runner.pieces is None
    assert [t[0] for t in _greedy(llm, prompts, max_tokens=4)] == [hf_greedy(hf_model, p, 4)[0] for p in prompts]
