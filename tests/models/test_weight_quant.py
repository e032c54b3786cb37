"""Weight-only quantization (``quantization="int8"`` / ``"gguf"``): the layers' error against the
float matmul, int8 loading of a tiny random HF Llama, GGUF Q8_0 / Q4_0 / Q4_1 blocks kept as
stored and matching the expanded-float load, tensor parallelism, and the settings that raise."""
import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import flags
from flax import nnx
from jax.sharding import PartitionSpec as P

from conftest import random_prompts
from jpaged import LLM, SamplingParams
from jpaged.config import EngineConfig
from jpaged.loading import load_model
from jpaged.loading.gguf_loader import GGUFBlocks
from jpaged.models.quantized import (GGUFEmbed, GGUFLinear, QuantizedEmbed, QuantizedLinear, dequantize_blocks,
                                     quantize_int8)
from jpaged.sharding import param_spec
from test_gguf import TINY, random_hf_weights, write_tiny_gguf
from test_models_paper import gpt2_dir, opt350m_style_dir  # noqa: F401  (fixtures)
from jpaged import testing

Q = gguf.GGMLQuantizationType
ENGINE = dict(num_kv_blocks=40, block_size=8, max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8)


# --------------------------------------------------------------------------- layers


def test_quantized_linear_error_within_the_rounding_bound():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((96, 40)).astype(np.float32) * rng.uniform(0.01, 3, 40).astype(np.float32)
    x = rng.standard_normal((7, 96)).astype(np.float32)
    bias = rng.standard_normal(40).astype(np.float32)
    q, scale = quantize_int8(w)
    assert q.dtype == np.int8 and scale.shape == (40,) and np.abs(q).max() == 127
    layer = QuantizedLinear(jnp.asarray(q), jnp.asarray(scale), bias=nnx.Param(jnp.asarray(bias)))
    got = np.asarray(layer(jnp.asarray(x)))
    exact = x @ w + bias
    # every weight is off by at most half a step of its column: |dy| <= sum|x| * scale / 2
    bound = np.abs(x).sum(1, keepdims=True) * scale[None] / 2 + 1e-4
    err = np.abs(got - exact)
    assert (err <= bound).all()
    assert 0 < err.max() and (err / (np.abs(x) @ np.abs(w) + 1e-6)).max() < 0.01


def test_quantized_embed_lookup_and_attend():
    rng = np.random.default_rng(1)
    table = rng.standard_normal((50, 32)).astype(np.float32)
    q, scale = quantize_int8(table, axis=1)
    assert scale.shape == (50,)
    emb = QuantizedEmbed(jnp.asarray(q), jnp.asarray(scale), jnp.float32)
    ids = jnp.array([3, 0, 49, 3])
    step = scale[np.asarray(ids)][:, None] / 2 + 1e-6
    assert (np.abs(np.asarray(emb(ids)) - table[np.asarray(ids)]) <= step).all()
    h = rng.standard_normal((2, 32)).astype(np.float32)
    bound = np.abs(h).sum(1, keepdims=True) * scale[None] / 2 + 1e-4
    assert (np.abs(np.asarray(emb.attend(jnp.asarray(h))) - h @ table.T) <= bound).all()


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_gguf_blocks_dequantize_as_gguf_does(qtype):
    rng = np.random.default_rng(2)
    w = rng.standard_normal((48, 96)).astype(np.float32)  # HF [out, in]
    rows = gguf.quants.quantize(w, qtype)
    reference = gguf.quants.dequantize(rows, qtype).reshape(w.shape)
    blocks = GGUFBlocks(qtype.name, rows, w.shape)
    qweight, scales, mins = blocks.parts()
    assert qweight.dtype == (np.int8 if qtype == Q.Q8_0 else np.uint8)
    assert qweight.shape == (3, 32 if qtype == Q.Q8_0 else 16, 48) and scales.shape == (3, 48)
    assert (mins is not None) == (qtype == Q.Q4_1)
    kernel = np.asarray(dequantize_blocks(qtype.name, jnp.asarray(qweight), jnp.asarray(scales),
                                          None if mins is None else jnp.asarray(mins)))
    np.testing.assert_allclose(kernel, reference.T, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(blocks.dequantize(), reference)

    args = [jnp.asarray(a) for a in (qweight, scales)] + ([jnp.asarray(mins)] if mins is not None else [])
    x = rng.standard_normal((5, 96)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(GGUFLinear(qtype.name, *args)(jnp.asarray(x))), x @ reference.T,
                               rtol=1e-5, atol=1e-4)
    table = GGUFEmbed(qtype.name, *args, dtype=jnp.float32)  # as a [vocab=48, hidden=96] table
    np.testing.assert_allclose(np.asarray(table(jnp.array([5, 0, 47]))), reference[[5, 0, 47]], atol=1e-6)


# --------------------------------------------------------------------------- int8 from HF safetensors


def greedy(llm, prompts, n=12):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, min_tokens=n), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def float_tokens(llama_dir):
    path, _ = llama_dir
    prompts = random_prompts(np.random.default_rng(0), [21, 9, 40, 14])
    return prompts, greedy(LLM(path, **ENGINE), prompts)


def test_int8_llama_from_safetensors_generates_and_agrees(llama_dir, float_tokens):
    path, _ = llama_dir
    prompts, expected = float_tokens
    llm = LLM(path, quantization="int8", **ENGINE)
    layer = testing.model_state(llm)["layers"][0]
    assert layer["mlp"]["up_proj"]["kernel"][...].dtype == jnp.int8
    assert layer["mlp"]["up_proj"]["scale"][...].shape == (128,)
    assert testing.model_state(llm)["embed_tokens"]["embedding"][...].dtype == jnp.int8
    tokens = greedy(llm, prompts)
    same = [a == b for got, want in zip(tokens, expected) for a, b in zip(got, want)]
    first = [got[0] == want[0] for got, want in zip(tokens, expected)]
    assert all(first) and np.mean(same) >= 0.75, (tokens, expected)


def test_int8_from_orbax_checkpoint(llama_dir, float_tokens, tmp_path):
    from jpaged.loading.orbax_checkpoint import save_checkpoint

    path, _ = llama_dir
    prompts, expected = float_tokens
    model, _, tokenizer = load_model(path, dtype=jnp.float32, attention_backend="xla")
    ckpt = save_checkpoint(model, str(tmp_path / "ckpt"), tokenizer)
    llm = LLM(ckpt, quantization="int8", **ENGINE)
    assert testing.model_state(llm)["layers"][1]["self_attn"]["o_proj"]["kernel"][...].dtype == jnp.int8
    tokens = greedy(llm, prompts)
    same = [a == b for got, want in zip(tokens, expected) for a, b in zip(got, want)]
    assert np.mean(same) >= 0.75
    quantized, _, _ = load_model(path, dtype=jnp.float32, attention_backend="xla", quantization="int8")
    with pytest.raises(ValueError, match="quantized layers"):
        save_checkpoint(quantized, str(tmp_path / "q"))


@pytest.mark.parametrize("fixture,linear,table", [
    ("opt350m_style_dir", ("project_in",), ("embed_tokens",)),  # project_in/out, tied, biases
    ("gpt2_dir", ("h", 0, "attn", "c_attn"), ("wte",)),           # Conv1D [in, out] kernels, tied
])
def test_int8_opt_and_gpt2(request, fixture, linear, table):
    path, _ = request.getfixturevalue(fixture)
    prompts = random_prompts(np.random.default_rng(7), [15, 26])
    expected = greedy(LLM(path, **ENGINE), prompts, n=8)
    llm = LLM(path, quantization="int8", **ENGINE)
    state = testing.model_state(llm)
    node, emb = state, state
    for key in linear:
        node = node[key]
    for key in table:
        emb = emb[key]
    assert node["kernel"][...].dtype == jnp.int8 and node["scale"][...].dtype == jnp.float32
    assert emb["embedding"][...].dtype == jnp.int8
    positions = state["wpe" if fixture == "gpt2_dir" else "embed_positions"]["embedding"][...]
    assert positions.dtype == jnp.float32  # position tables stay float
    tokens = greedy(llm, prompts, n=8)
    same = [a == b for got, want in zip(tokens, expected) for a, b in zip(got, want)]
    assert tokens[0][0] == expected[0][0] and np.mean(same) >= 0.75, (tokens, expected)


@pytest.mark.slow
def test_int8_tensor_parallel_matches_one_device(llama_dir):
    path, _ = llama_dir
    prompts = random_prompts(np.random.default_rng(3), [17, 30, 8])
    tokens = {}
    for tp in (1, 2):
        llm = LLM(path, quantization="int8", tensor_parallel_size=tp, **ENGINE)
        tokens[tp] = greedy(llm, prompts)
    assert tokens[1] == tokens[2]
    state = testing.model_state(llm)
    attn, mlp = state["layers"][0]["self_attn"], state["layers"][0]["mlp"]
    assert attn["q_proj"]["kernel"][...].sharding.spec == P(None, "model")
    assert attn["q_proj"]["scale"][...].sharding.spec == P("model")  # with its output channels
    assert mlp["down_proj"]["kernel"][...].sharding.spec == P("model", None)
    assert mlp["down_proj"]["scale"][...].sharding.spec == P()
    assert state["lm_head"]["scale"][...].sharding.spec == P("model")
    assert state["embed_tokens"]["embedding"][...].sharding.spec == P(None, "model")
    assert attn["q_proj"]["scale"][...].addressable_shards[0].data.shape == (32,)


# --------------------------------------------------------------------------- GGUF blocks kept


def _mixed_qtype(name):
    """Each matrix its own type, all three kinds in each layer."""
    if "embed_tokens" in name:
        return Q.Q8_0
    return [Q.Q4_0, Q.Q4_1, Q.Q8_0][sum(map(ord, name)) % 3]


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("wquant") / "mixed.gguf"
    weights = random_hf_weights(np.random.default_rng(4), "llama", tied=False, bias=False)
    write_tiny_gguf(path, "llama", {k: v * 0.1 for k, v in weights.items()}, _mixed_qtype)
    return str(path)


def test_gguf_kept_quantized_layers(mixed_gguf):
    model, _, _ = load_model(mixed_gguf, dtype=jnp.float32, attention_backend="xla", quantization="gguf")
    kinds = set()
    for layer in model.layers:
        for mod in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                    layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
            assert isinstance(mod, GGUFLinear)
            kinds.add(mod.kind)
    assert kinds == {"Q8_0", "Q4_0", "Q4_1"}
    assert isinstance(model.embed_tokens, GGUFEmbed) and model.embed_tokens.kind == "Q8_0"
    assert isinstance(model.lm_head, GGUFLinear)
    floats = [x for x in jax.tree.leaves(nnx.state(model)) if hasattr(x, "dtype") and x.dtype == jnp.float32
              and x.ndim > 1]
    assert not floats, "no float matrix left"


def test_gguf_kept_matches_expanded_float_logits(mixed_gguf):
    prompts = random_prompts(np.random.default_rng(5), [19, 33], vocab=TINY["vocab"])
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8, prompt_logprobs=3, logprobs=3)
    results = {}
    for quantization in (None, "gguf"):
        llm = LLM(mixed_gguf, quantization=quantization, **ENGINE)
        results[quantization] = llm.generate(prompts, params, use_tqdm=False)
    for ref, got in zip(results[None], results["gguf"]):
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids
        for a, b in zip(ref.prompt_logprobs[1:], got.prompt_logprobs[1:]):
            assert a.keys() == b.keys()
            np.testing.assert_allclose([b[k] for k in a], [a[k] for k in a], atol=2e-4)


@pytest.mark.slow
def test_gguf_kept_tensor_parallel(mixed_gguf):
    prompts = random_prompts(np.random.default_rng(6), [12, 27], vocab=TINY["vocab"])
    tokens = [greedy(LLM(mixed_gguf, quantization="gguf", tensor_parallel_size=tp, **ENGINE), prompts)
              for tp in (1, 4)]  # 4 devices > 2 KV heads: k/v blocks are repeated per head
    assert tokens[0] == tokens[1]


# --------------------------------------------------------------------------- settings


def test_bad_settings_raise_before_loading(llama_dir, tmp_path):
    path, hf_model = llama_dir
    with pytest.raises(ValueError, match="quantization='int4'"):
        LLM(path, quantization="int4")
    with pytest.raises(ValueError, match="quantization='gguf'.*not a .gguf file"):
        LLM(path, quantization="gguf")
    with pytest.raises(ValueError, match="quantization='gguf'"):
        EngineConfig(model=str(tmp_path), quantization="gguf")
    EngineConfig(model=None, quantization="gguf")  # the embedded default model is a GGUF file
    with pytest.raises(ValueError, match="quantization='gguf'"):
        load_model(path, dtype=jnp.float32, attention_backend="xla", quantization="gguf")
    model, _, _ = load_model(path, dtype=jnp.float32, attention_backend="xla")
    with pytest.raises(ValueError, match="quantization='int8'.*in-memory"):
        LLM.from_model(model, quantization="int8")


def test_scale_that_cannot_shard_is_a_value_error():
    assert param_spec(("layers", 0, "mlp", "up_proj", "scale"), (128,), 2) == P("model")
    assert param_spec(("layers", 0, "mlp", "down_proj", "scales"), (4, 64), 2) == P("model", None)
    with pytest.raises(ValueError, match="up_proj.scale.*cannot be split"):
        param_spec(("layers", 0, "mlp", "up_proj", "scale"), (4, 128), 2)  # per-block, not per channel
    with pytest.raises(ValueError, match="q_proj.scale"):
        param_spec(("layers", 0, "self_attn", "q_proj", "scale"), (), 2)  # one scale per tensor


def test_quantization_flag():
    from jpaged.entrypoints.engine_flags import define_engine_flags, llm_args

    fv = flags.FlagValues()
    define_engine_flags(fv)
    fv(["prog", "--quantization=int8"])
    assert llm_args(fv)[1] == {"quantization": "int8"}
    fv = flags.FlagValues()
    define_engine_flags(fv)
    with pytest.raises(flags.IllegalFlagValueError):
        fv(["prog", "--quantization=int4"])
