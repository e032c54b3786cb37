"""gpt-oss specifics beside the model-family harness (tests/models/test_model_families.py runs its
greedy parity with preemption, chunked prefill and prefix hits): the MXFP4 decode against
transformers' own, an MXFP4 checkpoint served token-exact, parallel samples, the default 128-token
sliding/full alternation, configs refused before any weight; the Pallas backend and TP 2 (slow)."""
import json
import os

import numpy as np
import pytest

from conftest import hf_greedy, random_prompts
from jpaged import LLM, SamplingParams
from jpaged.loading.mxfp4 import dequantize_mxfp4
from test_model_families import engine, family


def _random_mxfp4(rng, shape):
    blocks = rng.integers(0, 256, shape + (16,), dtype=np.uint8)
    scales = rng.integers(120, 134, shape, dtype=np.uint8)  # 2^-7 .. 2^6
    return blocks, scales


def test_mxfp4_decode_equals_transformers():
    """Every E2M1 code and a spread of E8M0 scales, decoded as transformers does (its
    dequantization, the one it applies to the released checkpoints)."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _random_mxfp4(np.random.default_rng(0), (3, 6, 2))
    blocks[0, 0, 0] = np.arange(256, dtype=np.uint8)[:16] * 17  # both nibbles take all 16 codes
    ours = dequantize_mxfp4(blocks, scales)
    theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    assert ours.shape == tuple(theirs.shape) == (3, 64, 6)
    np.testing.assert_array_equal(ours, theirs.numpy())
    with pytest.raises(ValueError, match="MXFP4"):
        dequantize_mxfp4(blocks[..., :8], scales)


def _mxfp4_checkpoint(tmp_path_factory):
    """The tiny gpt-oss with its expert weights replaced by random MXFP4 ones: a directory holding
    them packed (``*_blocks`` / ``*_scales``, as the released checkpoints), and the transformers
    model holding them dequantized by transformers."""
    import torch
    from safetensors.numpy import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    path, hf_model = family(tmp_path_factory, "gpt_oss")
    out = str(tmp_path_factory.mktemp("gpt_oss_mxfp4"))
    model = type(hf_model)(hf_model.config).eval()
    model.load_state_dict(hf_model.state_dict())
    rng = np.random.default_rng(1)
    tensors = {name: t.detach().numpy().copy() for name, t in model.state_dict().items()}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                e, din, dout = param.shape
                blocks, scales = _random_mxfp4(rng, (e, dout, din // 32))
                scales[:] = rng.integers(121, 125, scales.shape, dtype=np.uint8)  # weights ~0.1, like the model's
                param.copy_(convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                                       dtype=torch.float32))
                del tensors[name]
                tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    save_file(tensors, os.path.join(out, "model.safetensors"))
    config = json.load(open(os.path.join(path, "config.json")))
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    json.dump(config, open(os.path.join(out, "config.json"), "w"))
    return out, model


@pytest.mark.slow
def test_mxfp4_checkpoint_is_dequantized_at_load_and_token_exact(tmp_path_factory):
    path, hf_model = _mxfp4_checkpoint(tmp_path_factory)
    prompts = random_prompts(np.random.default_rng(2), [30, 5])
    llm = LLM(path, block_size=8, max_model_len=256, max_num_batched_tokens=16, num_kv_blocks=22)
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == [hf_greedy(hf_model, p, 8)[0] for p in prompts]
    # the experts hold the MXFP4 values exactly (float32 holds every E2M1 value times a power of two)
    gate = np.asarray(llm.llm_engine.runner.state["layers"][0]["mlp"]["experts"]["gate_proj"][...])
    np.testing.assert_array_equal(gate, hf_model.model.layers[0].mlp.experts.gate_up_proj[..., 0::2].detach().numpy())


@pytest.mark.slow
def test_parallel_samples_equal_the_single_greedy_one(tmp_path_factory):
    llm = engine(tmp_path_factory, "gpt_oss")
    prompts = random_prompts(np.random.default_rng(3), [14, 9])
    greedy = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    single = llm.generate(prompts, greedy, use_tqdm=False)
    many = llm.generate(prompts, SamplingParams(n=3, temperature=0, max_tokens=8, min_tokens=8), use_tqdm=False)
    for one, three in zip(single, many):
        assert all(c.token_ids == one.outputs[0].token_ids for c in three.outputs)
    m = llm.get_metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"]


def test_default_layers_alternate_128_token_windows():
    from transformers import GptOssConfig

    from jpaged.models import ModelConfig

    config = ModelConfig.from_hf(dict(GptOssConfig(num_hidden_layers=4).to_dict(), architectures=["GptOssForCausalLM"]))
    assert config.sliding_windows == (128, None, 128, None)


BASE = dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", vocab_size=64, hidden_size=32,
            intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            num_local_experts=4, num_experts_per_tok=2, attention_bias=True)


@pytest.mark.parametrize("change, field", [
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "rope_type"),
    (dict(num_experts_per_tok=8), "num_experts_per_tok"),
    (dict(attention_bias=False), "attention_bias"),
])
def test_configs_it_cannot_serve_are_refused_before_any_weight(tmp_path, change, field):
    from jpaged.loading import load_model

    (tmp_path / "config.json").write_text(json.dumps(dict(BASE, **change)))
    with pytest.raises(ValueError, match=field):
        load_model(str(tmp_path), dtype=np.float32, attention_backend="xla")


def test_120b_deployment_config_as_transformers_reads_it():
    """configs/models/gpt-oss-120b.json (transcribed from the published config): the engine's model
    facts and its windows equal transformers' GptOssConfig's, and the abstract model holds the
    published 116.8B parameters (128 experts of 3 x 2880 x 2880 in each of 36 layers)."""
    import jax
    import jax.numpy as jnp
    import transformers
    from flax import nnx

    from jpaged.loading import hf_checkpoint
    from jpaged.loading.model_loader import abstract_model
    from run_script import REPO_ROOT

    with open(os.path.join(REPO_ROOT, "configs", "models", "gpt-oss-120b.json")) as f:
        fields = json.load(f)
    mc = hf_checkpoint.model_config(fields, "gpt-oss-120b.json")
    theirs = transformers.GptOssConfig(**{k: v for k, v in fields.items() if k != "architectures"})
    assert (mc.num_layers, mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.vocab_size,
            mc.intermediate_size) == (theirs.num_hidden_layers, theirs.hidden_size, theirs.num_attention_heads,
                                      theirs.num_key_value_heads, theirs.head_dim, theirs.vocab_size,
                                      theirs.intermediate_size) == (36, 2880, 64, 8, 64, 201088, 2880)
    assert list(mc.sliding_windows) == [128 if t == "sliding_attention" else None for t in theirs.layer_types]
    assert mc.rope_scaling["rope_type"] == theirs.rope_parameters["rope_type"] == "yarn"
    model = abstract_model(mc, dtype=jnp.bfloat16, attention_backend="pallas")
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert round(params / 1e9, 1) == 116.8


def _tokens(llm, prompts, n):
    params = SamplingParams(temperature=0, max_tokens=n, min_tokens=n)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.slow  # Pallas interpret mode
def test_pallas_backend_equals_transformers(tmp_path_factory):
    """Sinks on the Pallas kernels (interpret mode here): the ragged kernel for the prompts, the
    decode kernel after, over a windowed and a global layer."""
    hf_model = family(tmp_path_factory, "gpt_oss")[1]
    prompts = random_prompts(np.random.default_rng(4), [20, 3])
    llm = engine(tmp_path_factory, "gpt_oss", attention_backend="pallas")
    assert _tokens(llm, prompts, 4) == [hf_greedy(hf_model, p, 4)[0] for p in prompts]


@pytest.mark.slow
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_tensor_parallel_2_equals_transformers(tmp_path_factory, expert_parallel):
    """Heads (and their sinks) split over 2 devices; the experts split on their intermediate axis
    (the down bias added once) or whole per device."""
    hf_model = family(tmp_path_factory, "gpt_oss")[1]
    prompts = random_prompts(np.random.default_rng(5), [30, 9])
    llm = engine(tmp_path_factory, "gpt_oss", tensor_parallel_size=2, enable_expert_parallel=expert_parallel)
    assert _tokens(llm, prompts, 8) == [hf_greedy(hf_model, p, 8)[0] for p in prompts]


@pytest.mark.slow
def test_dense_forward_equals_transformers_logits(tmp_path_factory):
    """The no-cache dense view (training, the oracle) honours this family's attention too."""
    import torch

    from jpaged.loading import load_model
    from jpaged.models.training import dense_logits

    path, hf_model = family(tmp_path_factory, "gpt_oss")
    model, _, _ = load_model(path, dtype=np.float32, attention_backend="xla")
    tokens = np.asarray(random_prompts(np.random.default_rng(9), [30, 30]))
    with torch.no_grad():
        want = hf_model(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(np.asarray(dense_logits(model, tokens)), want, atol=1e-4, rtol=1e-4)
