"""Tensor parallelism over 8 CPU devices: identical greedy tokens, and the shardings the design says."""
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import COMMON, _save, random_prompts
from jpaged import LLM, SamplingParams


@pytest.fixture(scope="module")
def mha8_dir(tmp_path_factory):
    from transformers import LlamaConfig

    cfg = dict(COMMON, num_attention_heads=8)
    return _save(tmp_path_factory, "mha8", LlamaConfig(num_key_value_heads=8, **cfg))


@pytest.fixture(scope="module")
def gqa2_dir(tmp_path_factory):
    from transformers import LlamaConfig

    cfg = dict(COMMON, num_attention_heads=8)
    return _save(tmp_path_factory, "gqa2", LlamaConfig(num_key_value_heads=2, **cfg))


def run(path, tp, prompts, **kwargs):
    llm = LLM(path, tensor_parallel_size=tp, num_kv_blocks=40, block_size=8, max_model_len=256,
              max_num_batched_tokens=64, enable_prefix_caching=True, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
    outs = llm.generate(prompts + prompts[:2], params, use_tqdm=False)  # repeats hit the prefix cache
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("fixture,kv_heads", [pytest.param("mha8_dir", 8, marks=pytest.mark.slow), ("gqa2_dir", 2)])
def test_tensor_parallel_tokens_identical_and_shardings(request, fixture, kv_heads):
    assert len(jax.devices()) >= 8, "conftest sets --xla_force_host_platform_device_count=8"
    path, _ = request.getfixturevalue(fixture)
    prompts = random_prompts(np.random.default_rng(0), [70, 9, 33, 51, 18, 64])
    expected = None
    for tp in (1, 2, 4, 8):
        llm, tokens = run(path, tp, prompts)
        m = llm.get_metrics()
        assert m["num_preemptions"] > 0 and m["prefix_cache_hits"] > 0
        assert m["num_free_blocks"] == m["num_total_blocks"]
        if expected is None:
            expected = tokens
        assert tokens == expected, f"tensor_parallel_size={tp}"
        runner = llm.llm_engine.runner
        layer = runner.state["layers"][0]
        assert layer["self_attn"]["q_proj"]["kernel"][...].sharding.spec == P(None, "model")
        assert layer["self_attn"]["o_proj"]["kernel"][...].sharding.spec == P("model", None)
        assert layer["mlp"]["down_proj"]["kernel"][...].sharding.spec == P("model", None)
        assert runner.state["lm_head"]["kernel"][...].sharding.spec == P(None, "model")
        table = runner.state["embed_tokens"]["embedding"][...]
        assert table.sharding.spec == P(None, "model") and table.format.layout.major_to_minor == (0, 1)
        # a weight update or wake-up places the table in the same order (`sharding.param_format`)
        assert runner.weight_targets.specs[("embed_tokens", "embedding")].format.layout.major_to_minor == (0, 1)
        k_pages = runner.kv_pool.caches[0][0]
        assert k_pages.sharding.spec == P("model", None, None, None)
        assert len(k_pages.sharding.device_set) == tp
        heads_total = max(kv_heads, tp)  # fewer KV heads than devices: replicated
        assert k_pages.shape[0] == heads_total
        assert k_pages.addressable_shards[0].data.shape[0] == heads_total // tp


def test_tensor_parallel_decode_windows(gqa2_dir):
    path, _ = gqa2_dir
    prompts = random_prompts(np.random.default_rng(2), [30, 9, 17])
    _, expected = run(path, 1, prompts)
    for tp in (2, 4):
        llm, tokens = run(path, tp, prompts, num_scheduler_steps=4)
        assert tokens == expected, f"tensor_parallel_size={tp} with decode windows"
        assert llm.get_metrics()["num_free_blocks"] == llm.get_metrics()["num_total_blocks"]


def test_data_parallel_replicas_on_disjoint_devices(gqa2_dir):
    path, _ = gqa2_dir
    prompts = random_prompts(np.random.default_rng(1), [12, 40, 7, 25, 33, 5])
    _, expected = run(path, 1, prompts)
    llm = LLM(path, data_parallel_size=2, tensor_parallel_size=2, num_kv_blocks=40, block_size=8,
              max_model_len=256, max_num_batched_tokens=64)
    outs = llm.generate(prompts + prompts[:2], SamplingParams(temperature=0, max_tokens=12, min_tokens=12),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    replicas = llm.llm_engine.replicas
    device_sets = [set(r.runner.kv_pool.caches[0][0].sharding.device_set) for r in replicas]
    assert len(device_sets[0]) == 2 and not device_sets[0] & device_sets[1]
    per_replica = llm.get_metrics()["replicas"]
    assert all(m["prefix_cache_queries"] > 0 for m in per_replica), "both replicas served requests"
    assert llm.get_metrics()["num_free_blocks"] == 80


def test_embedding_tables_are_placed_row_major():
    """XLA:TPU may keep a table whose rows pad its tiles column-major, and a step then copies it for
    the gather every step (tests/entrypoints/test_aot_engine.py measures it); `param_format` names
    row-major order for every embedding table, the sharding alone for the other weights."""
    from jax.experimental.layout import Format

    from jpaged import sharding

    mesh = sharding.make_mesh(2)
    table = sharding.param_format(("embed_tokens", "embedding"), (64, 32), mesh)
    assert isinstance(table, Format) and table.layout.major_to_minor == (0, 1)
    assert table.sharding.spec == P(None, "model")
    kernel = sharding.param_format(("layers", 0, "mlp", "up_proj", "kernel"), (32, 64), mesh)
    assert kernel.spec == P(None, "model")
    x = jax.device_put(np.zeros((64, 32), np.float32), table)
    assert sharding.is_placed(x, table) and not sharding.is_placed(x, sharding.replicated(mesh))
    assert not sharding.is_placed(np.zeros((64, 32), np.float32), table)
