"""The roofline estimate of a deployment (`jpaged.entrypoints.roofline`, in `scripts/aot_compile.py`'s
summary and ``--output_json``): its arithmetic by hand, the chips' published figures, and what it
reads from a model's abstract parameters (no compiler, no weights)."""
import jax
import jax.numpy as jnp
import pytest

from jpaged import sharding
from jpaged.entrypoints import aot, roofline
from jpaged.loading import hf_checkpoint
from pallas_kernels.aot import targets

V6E, H100 = targets.get("v6e"), targets.get("h100")

# Llama-3.1-8B in bfloat16 on one chip, by hand: 7.50e9 matmul weights besides the input table
# (lm_head untied), 32 layers of 8 KV heads x 128 (4,096 KV bytes per token and layer), 32 query heads.
LLAMA_8B = roofline.StepCost(weight_bytes=int(15.0e9), expert_bytes=0, dense_params=int(7.5e9), expert_params=0,
                             num_experts=0, experts_per_token=0, kv_bytes_per_token_layer=4096.0,
                             layer_windows=(None,) * 32, attention_width=32 * 128)


def test_decode_step_reads_the_weights_and_the_batch_kv():
    """A decode step's floor: weights + rows x layers x context x KV bytes over the bandwidth, or
    its FLOPs over the peak when those take longer."""
    b = roofline.decode_step(LLAMA_8B, V6E, rows=64, context=2000)
    kv = 64 * 32 * 2000 * 4096
    assert b.bytes == 15.0e9 + kv
    assert b.flops == 64 * (2 * 7.5e9 + 4 * 4096 * 32 * 2000)
    assert b.seconds == pytest.approx((15.0e9 + kv) / 1638e9) and b.bound_by == "memory"
    one = roofline.decode_step(LLAMA_8B, V6E, rows=1, context=2000)
    assert one.seconds < b.seconds and 1 / one.seconds < 64 / b.seconds  # more rows: more tokens per second
    prompt = roofline.prompt(LLAMA_8B, V6E, tokens=1800)
    assert prompt.bound_by == "compute" and prompt.seconds == pytest.approx(prompt.flops / 918e12)
    assert prompt.flops > 1800 * 2 * 7.5e9


def test_windowed_layers_read_their_window_and_experts_their_share():
    cost = roofline.StepCost(weight_bytes=1000, expert_bytes=800, dense_params=100, expert_params=400,
                             num_experts=8, experts_per_token=2, kv_bytes_per_token_layer=10.0,
                             layer_windows=(None, 64), attention_width=4)
    assert cost.keys(1000) == 1000 + 64 and cost.keys(10) == 20
    assert roofline.causal_keys(100, 64) == 64 * 65 // 2 + 36 * 64 and roofline.causal_keys(5, None) == 15
    assert cost.expert_share(1) == pytest.approx(2 / 8) and cost.expert_share(64) == pytest.approx(1, abs=1e-7)
    assert cost.weights_read(1) == pytest.approx(200 + 800 / 4)
    assert cost.flops_per_token() == 2 * (100 + 400 / 4)


def test_the_workload_bound_is_above_what_a_real_chip_serves():
    """Llama-3.1-8B on one v6e, its pool of 13.7 GiB: tpu-inference's CI gate for this workload is
    10.77 req/s measured on the chip, so a floor on time must allow more; at most as many requests
    run at once as the pool holds."""
    per_request_blocks = -(-(1800 + 128) // 16)
    pool_requests = int(13.7 * 2**30) // (4096 * 32 * 16) // per_request_blocks
    w = roofline.workload(LLAMA_8B, V6E, batch=pool_requests, max_batched_tokens=2048)
    assert w["batch"] == pool_requests == 57
    assert 10.77 < w["requests_per_s"] < 10 * 10.77
    assert w["output_tokens_per_s"] == pytest.approx(w["requests_per_s"] * 128)
    fewer = roofline.workload(LLAMA_8B, V6E, batch=8, max_batched_tokens=2048)
    assert fewer["requests_per_s"] < w["requests_per_s"]
    assert roofline.workload(LLAMA_8B, V6E, batch=0, max_batched_tokens=2048)["requests_per_s"] == 0.0
    faster = roofline.workload(LLAMA_8B, targets.get("h200"), batch=pool_requests, max_batched_tokens=2048)
    assert faster["requests_per_s"] > roofline.workload(LLAMA_8B, H100, batch=pool_requests,
                                                        max_batched_tokens=2048)["requests_per_s"]


@pytest.mark.parametrize("name", sorted(targets.TARGETS))
def test_every_target_has_its_published_figures(name):
    t = targets.get(name)
    assert t.hbm_bytes_per_s > 0.5e12 and t.peak_flops > 100e12 and t.spec_url.startswith("https://")
    assert ("cloud.google.com/tpu" if t.platform == "tpu" else "nvidia.com") in t.spec_url


def tiny_config(cls_name: str, **extra):
    import transformers

    config = getattr(transformers, cls_name)(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                             vocab_size=256, max_position_embeddings=512, **extra)
    fields = config.to_dict()
    fields["architectures"] = ["Qwen3MoeForCausalLM" if "Moe" in cls_name else "LlamaForCausalLM"]
    return hf_checkpoint.model_config(fields, "config.json")


@pytest.mark.parametrize("cls_name, extra", [
    ("LlamaConfig", {}),
    ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
])
def test_the_cost_comes_from_the_abstract_parameters(cls_name, extra):
    """Bytes are the chip's weights less the input-embedding table; stacked experts are told apart
    (their share is routed), with the model's expert count and top-k."""
    mc = tiny_config(cls_name, tie_word_embeddings=False, **extra)
    mesh = sharding.make_mesh(1, jax.devices()[:1])
    _, state, layout = aot.abstract_state(mc, mesh, dtype=jnp.float32, quantization=None)
    leaves = jax.tree_util.tree_leaves_with_path(state)
    total = sum(x.size * 4 for _, x in leaves)
    per_block = 2 * 2 * 2 * 16 * 16 * 4  # K and V, 2 layers, 2 heads, 16 slots of 16 float32
    steps = [aot.StepCompile("tokens=4 rows=4 greedy decode-only", True), aot.StepCompile("tokens=8 rows=2 sampled", True)]
    estimate = aot.deployment_roofline(state, mc, layout, "v5e", per_block=per_block, block_size=16, tp=1,
                                       num_blocks=1000, max_num_seqs=4, max_batched_tokens=64, max_model_len=2048,
                                       steps=steps)
    cost = roofline.step_cost([(sharding.key_path_names(p), x.shape, 4) for p, x in leaves], config=mc, layout=layout,
                              kv_bytes_per_block=per_block, block_size=16, tensor_parallel_size=1,
                              is_expert=aot.is_stacked_expert)
    assert cost.weight_bytes == total - 256 * 64 * 4
    assert cost.kv_bytes_per_token_layer == 2 * 2 * 16 * 4 and cost.attention_width == 4 * 16
    if extra:
        assert (cost.num_experts, cost.experts_per_token) == (4, 2)
        assert cost.expert_bytes == 2 * 3 * 4 * 64 * 32 * 4 and cost.expert_params == cost.expert_bytes // 4
    else:
        assert cost.expert_bytes == 0 and cost.num_experts == 0
    assert estimate["label"].startswith("estimate, not a measurement") and estimate["source"] == targets.get("v5e").spec_url
    assert [s["rows"] for s in estimate["decode_steps"]] == [4]
    assert estimate["workload"]["batch"] == 4  # max_num_seqs, below the 1000 // 121 requests the pool holds
    short = aot.deployment_roofline(state, mc, layout, "v5e", per_block=per_block, block_size=16, tp=1,
                                    num_blocks=1000, max_num_seqs=4, max_batched_tokens=64, max_model_len=512,
                                    steps=steps)
    assert short["workload"]["batch"] == 0 and "max_model_len=512" in short["workload"]["note"]
    bound = roofline.decode_step(cost, targets.get("v5e"), 4, 1864)
    assert estimate["decode_steps"][0]["min_step_ms"] == pytest.approx(bound.seconds * 1e3)
