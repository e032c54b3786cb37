"""The whole engine step compiles ahead of time for TPU and GPU targets (`scripts/aot_compile.py`,
`jpaged.entrypoints.aot`), without weights or a device, with the real compilers.

Default run: a Llama over two v5e chips, a head_dim-64 Llama's pool kept row-major on v5e (v6e: slow), a
gpt-oss-vocabulary token table kept row-major on v5e, a Gemma 2 on v6e (windowed and global KV-cache groups,
soft caps) and a Mixtral over two H100s (experts split whole), through the script as a user runs
it: exit status 0, every step shape OK, a KV pool that fits, the figures in ``--output_json``.
``-m slow``: Qwen3, Gemma 3, Mistral, Qwen3-MoE and Qwen3-Next on v5e and H100, and every deployment flagfile
of ``configs/`` (its largest step shapes) on the target its ``# Compile:`` line names, in bfloat16
and, on the GPUs, with an int8 KV cache. The compilers' venvs come from
``scripts/setup_aot_compilers.sh`` (``JPAGED_SKIP_AOT=1`` skips these tests, as it does the kernel
compile tests).
"""
import glob
import json
import os
import re

import pytest

from pallas_kernels.aot import venv
from run_script import REPO_ROOT as REPO, run_script

# head_dim 128 (the TPU kernels' lane width), GQA group 2, two layers (Gemma 3: one windowed, one global)
TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            head_dim=128, vocab_size=512, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)
FAMILIES = {
    "llama": ("LlamaConfig", TINY),
    "llama_d64": ("LlamaConfig", dict(TINY, head_dim=64, num_attention_heads=16, num_key_value_heads=8)),
    "qwen3": ("Qwen3Config", TINY),
    "gemma2": ("Gemma2Config", dict(TINY, sliding_window=64, query_pre_attn_scalar=128, attn_logit_softcapping=50.0,
                                    final_logit_softcapping=30.0)),
    "gemma3": ("Gemma3TextConfig", dict(TINY, sliding_window=64, query_pre_attn_scalar=128,
                                        layer_types=["sliding_attention", "full_attention"])),
    "mistral": ("MistralConfig", dict(TINY, sliding_window=64)),
    "mixtral": ("MixtralConfig", dict(TINY, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128)),
    "qwen3_moe_64": ("Qwen3MoeConfig", dict(TINY, num_experts=64, num_experts_per_tok=2, moe_intermediate_size=128)),
    # a linear-attention layer (its recurrent-state pool) and a full-attention one, MoE with a shared expert
    "qwen3_next": ("Qwen3NextConfig", dict(TINY, layer_types=["linear_attention", "full_attention"],
                                           linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128,
                                           linear_value_head_dim=128, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=128, shared_expert_intermediate_size=128)),
}
ENGINE = ["--max_num_seqs=4", "--max_num_batched_tokens=32", "--max_model_len=256", "--block_size=16"]


@pytest.fixture(autouse=True)
def _compilers():
    for platform in ("tpu", "cuda"):
        why = venv.missing(platform)
        if why is not None:
            if os.environ.get("JPAGED_SKIP_AOT") == "1":
                pytest.skip(why)
            pytest.fail(f"{why} (or set JPAGED_SKIP_AOT=1 to skip the deviceless compile tests)")


def model_json(tmp_path, name: str, **overrides) -> str:
    """A config.json of the family's small model (transformers' fields, no weights), ``overrides``
    changing its fields."""
    import transformers

    cls_name, kwargs = FAMILIES[name]
    config = getattr(transformers, cls_name)(**dict(kwargs, **overrides))
    fields = config.to_dict()
    fields["architectures"] = [{"gemma3": "Gemma3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "mixtral": "MixtralForCausalLM",
                                "qwen3_moe": "Qwen3MoeForCausalLM", "qwen3_moe_64": "Qwen3MoeForCausalLM", "qwen3": "Qwen3ForCausalLM",
                                "mistral": "MistralForCausalLM", "qwen3_next": "Qwen3NextForCausalLM"}.get(name, "LlamaForCausalLM")]
    path = tmp_path / f"{name}{''.join(f'-{k}={v}' for k, v in overrides.items())}.json"
    path.write_text(json.dumps(fields))
    return str(path)


def aot_compile(tmp_path, *flags, timeout=3000) -> dict:
    """Runs the script; returns its --output_json figures (the run must succeed)."""
    out = tmp_path / "aot.json"
    result = run_script("aot_compile.py", *flags, f"--output_json={out}", timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["ok"] and figures["fits"] and figures["num_blocks"] > 0, figures
    assert all(step["ok"] for step in figures["steps"]), figures["steps"]
    return figures


@pytest.mark.parametrize("name, target", [
    ("llama", ["--topology=v5e:2x2", "--tensor_parallel_size=2"]),
    pytest.param("gemma2", ["--topology=v6e:2x2"], marks=pytest.mark.slow),
    pytest.param("mixtral", ["--gpu=h100", "--enable_expert_parallel", "--tensor_parallel_size=2"],
                 marks=pytest.mark.slow),
    pytest.param("llama", ["--topology=v5e:2x2", "--attention_backend=xla"], marks=pytest.mark.slow),
])
def test_small_models_compile(tmp_path, name, target):
    """A Llama over two v5e chips (the decode-only and mixed steps, greedy and sampled), a Gemma 2 on
    v6e (windowed and global KV-cache groups, soft caps), a Mixtral on two H100s, experts split, and
    a Llama on the xla attention backend (the jnp loops, as ``--attention_backend=xla`` serves)."""
    figures = aot_compile(tmp_path, f"--model={model_json(tmp_path, name)}", *target, *ENGINE, "--shapes=edges")
    names = [step["name"] for step in figures["steps"]]
    assert any(n.endswith("decode-only") for n in names) and any("sampled" in n for n in names), names
    assert figures["num_devices"] == (2 if "--tensor_parallel_size=2" in target else 1)
    assert figures["attention_backend"] == ("xla" if "--attention_backend=xla" in target else "pallas")
    assert figures["weight_bytes"] > 0 and figures["max_temp_bytes"] > 0
    roofline = figures["roofline"]  # the estimate beside the fit (tests/entrypoints/test_roofline.py checks its arithmetic)
    assert roofline["label"].startswith("estimate") and roofline["source"].startswith("https://")
    assert [s["rows"] for s in roofline["decode_steps"]] and all(s["min_step_ms"] > 0 for s in roofline["decode_steps"])
    # ENGINE's max_model_len (256) is below the workload's 1,928 tokens: no batch, and the reason
    assert roofline["workload"]["batch"] == 0 and "max_model_len=256" in roofline["workload"]["note"]


@pytest.mark.slow
def test_speculative_verification_steps_compile(tmp_path):
    """With prompt lookup, the plan holds verification steps (rows past max_num_seqs) too."""
    figures = aot_compile(tmp_path, f"--model={model_json(tmp_path, 'llama')}", "--gpu=h100", *ENGINE, "--shapes=edges",
                          '--speculative_config={"method": "ngram", "num_speculative_tokens": 2}')
    rows = [int(step["name"].split("rows=")[1].split()[0]) for step in figures["steps"] if "verification" in step["name"]]
    assert rows and max(rows) > 4, figures["steps"]  # max_num_seqs=4: more rows are proposals'
    result = run_script("aot_compile.py", f"--model={model_json(tmp_path, 'llama')}", "--gpu=h100",
                        '--speculative_config={"method": "draft_model", "model": "smollm2-135m-instruct"}')
    assert result.returncode == 2 and "only 'ngram'" in result.stderr


def test_tier_block_moves_compile(tmp_path):
    """With prefix-cache tiers, the pool's block gather and scatter of every padded count compile too."""
    from jpaged.runner.kv_pool import transfer_buckets

    figures = aot_compile(tmp_path, f"--model={model_json(tmp_path, 'llama')}", "--gpu=h100", *ENGINE,
                          "--shapes=largest", '--kv_offload={"host_bytes": 1048576}')
    moves = [step["name"] for step in figures["steps"] if step["name"].startswith("kv_offload")]
    counts = transfer_buckets(figures["num_blocks"])
    assert moves == [f"kv_offload {op} blocks={n}" for n in counts for op in ("gather", "scatter")], moves


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3", "gemma3", "mistral", "qwen3_moe", "qwen3_next"])
@pytest.mark.parametrize("target", ["--topology=v5e:2x2", "--gpu=h100"])
def test_every_family_compiles(tmp_path, name, target):
    aot_compile(tmp_path, f"--model={model_json(tmp_path, name)}", target, *ENGINE, "--shapes=edges")


@pytest.mark.parametrize("topology", ["v5e:2x2", pytest.param("v6e:2x2", marks=pytest.mark.slow)])
def test_a_head_dim_64_pool_is_not_copied_around_the_step(tmp_path, topology):
    """XLA:TPU's default order for pages of head_dim 64 is not row-major; a step taking the pool in
    it copied the whole pool around the kernels (measured on v5e with this model and pool: 271 MB of
    temporaries for a 268 MB pool). The pool is created and passed row-major
    (`sharding.kv_pool_format`): the temporaries are a small fraction of it (0.9 MB)."""
    figures = aot_compile(tmp_path, f"--model={model_json(tmp_path, 'llama_d64')}", f"--topology={topology}",
                          *ENGINE, "--block_size=32", "--num_kv_blocks=2048", "--shapes=largest")
    assert figures["kv_pool_bytes"] == 2048 * figures["kv_bytes_per_block"] == 256 * 2**20
    assert figures["max_temp_bytes"] < figures["kv_pool_bytes"] / 16, figures["steps"]


def test_an_embedding_table_is_not_copied_every_step(tmp_path):
    """XLA:TPU's default order for gpt-oss's token table shard (bf16[201088, 360] on v6e-8: rows
    that pad the 128 lanes) is column-major, and a step taking it so copied the whole table for the
    rows' gather, every step (measured here, hidden 720 over two v5e chips: 149 MiB of temporaries).
    Embedding tables are placed and passed row-major (`sharding.param_format`): 1 MiB."""
    model = model_json(tmp_path, "llama", hidden_size=720, vocab_size=201088, num_hidden_layers=1)
    figures = aot_compile(tmp_path, f"--model={model}", "--topology=v5e:2x2", "--tensor_parallel_size=2", *ENGINE,
                          "--shapes=largest")
    table_shard_bytes = 201088 * 360 * 2
    assert figures["max_temp_bytes"] < table_shard_bytes / 16, figures["steps"]


@pytest.mark.slow
def test_moe_temporaries_are_one_layers_routed_activations(tmp_path):
    """XLA:GPU's ``ragged_dot`` expands the sorted rows to one masked copy per expert ([E, T * k,
    hidden]: 8 GiB for Qwen3-30B-A3B's 2,048 tokens); the GPU runs the experts' tiled loop instead.
    Here 64 experts, 512 tokens of 2 experts each: 45 MiB of temporaries with ``ragged_dot``
    (measured); with the loop they stay under 16 MiB (the routed rows: 0.5 MiB per matmul). And
    they do not grow with the layers: buffers made from the constant 0 were fused across layers
    and all live at once (measured: 3.8 MiB with one layer, 14.9 with eight; now 3.8 and 4.3)."""
    figures = aot_compile(tmp_path, f"--model={model_json(tmp_path, 'qwen3_moe_64')}", "--gpu=h100", *ENGINE,
                          "--max_num_batched_tokens=512", "--shapes=largest")
    assert figures["max_temp_bytes"] < 16 * 2**20, figures["steps"]
    by_layers = {}
    for layers in (1, 8):
        model = model_json(tmp_path, "qwen3_moe_64", num_hidden_layers=layers)
        by_layers[layers] = aot_compile(tmp_path, f"--model={model}", "--gpu=h100", *ENGINE,
                                        "--max_num_batched_tokens=512", "--shapes=largest")["max_temp_bytes"]
    assert by_layers[8] < 1.2 * by_layers[1], by_layers


def test_bad_flags_exit_2(tmp_path):
    result = run_script("aot_compile.py", f"--model={model_json(tmp_path, 'llama')}", "--gpu=h100", "--topology=v5e:2x2")
    assert result.returncode == 2 and "exactly one of --topology" in result.stderr
    result = run_script("aot_compile.py", "--model=/nonexistent", "--gpu=h100")
    assert result.returncode == 2 and "/nonexistent" in result.stderr


def deployments():
    """(flagfile, target flag) of each configs/*.flags, the target from its '# Compile:' line."""
    found = []
    for path in sorted(glob.glob(os.path.join(REPO, "configs", "*.flags"))):
        line = next(line for line in open(path) if line.startswith("# Compile:"))
        found.append((os.path.basename(path), re.search(r"--(topology|gpu)=\S+", line).group(0)))
    return found


def test_every_deployment_names_its_target():
    assert len(deployments()) >= 6


def deployment_cases():
    """Every deployment in bfloat16, and with an int8 KV cache on the GPUs (a TPU deployment's int8
    compile takes 4-11 minutes on two cores: docs/tpu_gpu.md's table has those figures, from the same
    command; the int8 kernels compile for TPU in `test_aot_kernels.py`'s default run)."""
    cases = []
    for f, t in deployments():
        long_compile = any(line.startswith("# Long compile:") for line in open(os.path.join(REPO, "configs", f)))
        marks = [pytest.mark.skipif(os.environ.get("JPAGED_LONG_COMPILES") != "1",
                                    reason=f"{f}: a long compile (its '# Long compile:' line); JPAGED_LONG_COMPILES=1 runs it")
                 ] if long_compile else []
        cases += [pytest.param(f, t, kv, marks=marks) for kv in ("auto", "int8") if kv == "auto" or "--gpu" in t]
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("flagfile, target, kv", deployment_cases())
def test_deployment_configs_compile_and_fit(tmp_path, flagfile, target, kv):
    """The deployment's largest step shapes (what decides the fit) compile and fit."""
    figures = aot_compile(tmp_path, f"--flagfile={os.path.join(REPO, 'configs', flagfile)}", target,
                          f"--kv_cache_dtype={kv}", "--shapes=largest")
    assert figures["max_batch_at_max_model_len"] >= 1, figures
