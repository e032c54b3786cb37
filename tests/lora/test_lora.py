"""LoRA adapters served beside the base model: PEFT adapters, mixed batches, slots, bad input.

The oracle is transformers + peft with the adapter merged (``merge_and_unload``), in float32."""
import copy
import json
import os

import numpy as np
import pytest

from conftest import hf_greedy, random_prompts

pytest.importorskip("peft")

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base_model, path, *, r=8, alpha=16, targets=ALL_MODULES, seed=0, rslora=False, rank_pattern=None):
    """A PEFT LoRA adapter of ``base_model`` with random A and B, saved to ``path``; returns the
    merged transformers model (the oracle)."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False,
                        use_rslora=rslora, rank_pattern=rank_pattern or {}, lora_dropout=0.0)
    peft_model = get_peft_model(copy.deepcopy(base_model), config)
    with torch.no_grad():  # B at the scale of a trained adapter: visible in the tokens, not chaos
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.mul_(0.5)
    peft_model.save_pretrained(str(path))
    return peft_model.merge_and_unload().eval()


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory):
    """Three Llama adapters (all modules r=8; attention only r=4 with rsLoRA; MLP with a rank
    pattern) and their merged oracles."""
    _, base = llama_dir
    root = tmp_path_factory.mktemp("lora")
    specs = {"all": dict(r=8, alpha=16, seed=1),
             "attn": dict(r=4, alpha=8, targets=["q_proj", "v_proj", "o_proj"], seed=2, rslora=True),
             "mlp": dict(r=8, alpha=8, targets=["gate_proj", "up_proj", "down_proj"], seed=3,
                         rank_pattern={"down_proj": 16})}
    return {name: (str(root / name), make_adapter(base, root / name, **spec)) for name, spec in specs.items()}


@pytest.fixture(scope="module")
def llm(llama_dir):
    from jpaged import LLM

    return LLM(llama_dir[0], enable_lora=True, max_loras=3, max_lora_rank=16, max_cpu_loras=3, num_kv_blocks=128,
               max_num_seqs=8, max_num_batched_tokens=256)


def requests_of(adapters):
    from jpaged import LoRARequest

    return {name: LoRARequest(name, i + 1, path) for i, (name, (path, _)) in enumerate(sorted(adapters.items()))}


def greedy(max_tokens=12):
    from jpaged import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)


def assert_no_leak(llm):
    m = llm.get_metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"], "blocks leaked"
    assert m["lora_slots_in_use"] == 0, "a LoRA slot stayed pinned"


def test_each_adapter_alone_matches_merged_peft(llm, llama_dir, adapters):
    prompts = random_prompts(np.random.default_rng(0), [5, 19])
    reqs = requests_of(adapters)
    base = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False)]
    assert base == [hf_greedy(llama_dir[1], p, 12)[0] for p in prompts]
    for name, (_, merged) in adapters.items():
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False,
                                                               lora_request=reqs[name])]
        assert outs == [hf_greedy(merged, p, 12)[0] for p in prompts], name
        assert outs != base, f"{name}: the adapter changed no token (the test would not see it missing)"
    assert_no_leak(llm)


def test_mixed_batch_three_adapters_and_base(llm, llama_dir, adapters):
    """One engine step runs 3 adapters and the base model together (every token's slot is step
    data); each request's tokens are those of its own merged model."""
    engine = llm.llm_engine
    reqs = requests_of(adapters)
    names = ["all", None, "attn", "mlp", "all", None, "mlp", "attn"]
    prompts = random_prompts(np.random.default_rng(1), [3, 7, 11, 17, 4, 9, 13, 6])
    for i, (name, prompt) in enumerate(zip(names, prompts)):
        engine.add_request(f"mixed-{i}", prompt, greedy(10), lora_request=reqs.get(name))
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps += 1
        if steps == 1:  # the first step: all eight requests, the three adapters pinned at once
            assert len(engine.scheduler.running) == 8
            assert engine.get_metrics()["lora_slots_in_use"] == 3
        done.update({o.request_id: o for o in outputs if o.finished})
    for i, (name, prompt) in enumerate(zip(names, prompts)):
        oracle = llama_dir[1] if name is None else adapters[name][1]
        assert done[f"mixed-{i}"].outputs[0].token_ids == hf_greedy(oracle, prompt, 10)[0], name
    assert_no_leak(llm)


_COMPILES = [0]


def _count_compile(event: str, duration: float, **_) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES[0] += 1


def test_switching_adapters_never_recompiles(llm, adapters):
    """Neither the step nor the slot writes compile again when adapters switch (the engine's
    counter, and JAX's own compile events: the writes happen outside the counted pieces)."""
    import jax

    jax.monitoring.register_event_duration_secs_listener(_count_compile)
    reqs = requests_of(adapters)
    prompt = random_prompts(np.random.default_rng(2), [6])
    llm.generate(prompt, greedy(4), use_tqdm=False, lora_request=reqs["all"])  # warm
    before, compiles = llm.get_metrics()["num_compilations"], _COMPILES[0]
    for name in ("attn", "mlp", "all", "attn", "mlp"):
        for slot in range(1, 4):  # every adapter is written into a slot again
            llm.llm_engine.lora.slots.forget_slot(slot)
        llm.generate(prompt, greedy(4), use_tqdm=False, lora_request=reqs[name])
    llm.generate(prompt, greedy(4), use_tqdm=False)
    assert llm.get_metrics()["num_compilations"] == before
    assert _COMPILES[0] == compiles, "a slot write or a step compiled again"


def test_slot_write_updates_in_place(llm, adapters):
    """Writing an adapter into a slot replaces only the LoRA stacks' buffers (donated), every
    other leaf of the state stays the same object, and the layer pieces see the new stacks."""
    import jax

    runner = llm.llm_engine.runner
    reqs = requests_of(adapters)
    before = jax.tree.leaves(runner.state)
    lora_ids = {id(before[i]) for i in runner._lora_writer.indices}
    runner.write_lora_slots([(2, reqs["mlp"])])
    after = jax.tree.leaves(runner.state)
    assert all(a is b for i, (a, b) in enumerate(zip(before, after)) if i not in runner._lora_writer.indices)
    written = {runner._lora_writer.keys[k]: after[i] for k, i in enumerate(runner._lora_writer.indices)}
    weights = llm.llm_engine.lora.adapter(reqs["mlp"]).weights
    (layer, name), (a, b) = next(iter(weights.items()))
    np.testing.assert_array_equal(np.asarray(written[(layer, name, 0)][2]), a)
    np.testing.assert_array_equal(np.asarray(written[(layer, name, 1)][2]), b)
    assert not np.asarray(written[(0, "q_proj", 0)][2]).any(), "an untargeted projection kept old rows"
    if runner.pieces is not None:
        piece_ids = {id(x) for leaves in runner.pieces.layer_leaves for x in leaves}
        assert not lora_ids & piece_ids, "the layer pieces still hold a donated stack"
        assert {id(after[i]) for i in runner._lora_writer.indices} <= piece_ids
    llm.llm_engine.lora.slots.forget_slot(2)  # the test wrote it behind the slot table's back


def test_prefix_cache_is_keyed_by_adapter(llm, llama_dir, adapters):
    """The same prompt under two adapters never shares blocks; under one adapter it does."""
    reqs = requests_of(adapters)
    prompt = random_prompts(np.random.default_rng(3), [40])
    first = llm.generate(prompt, greedy(6), use_tqdm=False, lora_request=reqs["all"])[0]
    again = llm.generate(prompt, greedy(6), use_tqdm=False, lora_request=reqs["all"])[0]
    other = llm.generate(prompt, greedy(6), use_tqdm=False, lora_request=reqs["attn"])[0]
    assert again.num_cached_tokens > 0
    assert other.num_cached_tokens == 0
    assert other.outputs[0].token_ids == hf_greedy(adapters["attn"][1], prompt[0], 6)[0]
    assert first.outputs[0].token_ids == again.outputs[0].token_ids


def _in_memory(adapters, name):
    """(tensors, config) of a fixture adapter, as a trainer would hand them over: no directory."""
    from safetensors.numpy import load_file

    path = adapters[name][0]
    with open(os.path.join(path, "adapter_config.json")) as f:
        return load_file(os.path.join(path, "adapter_model.safetensors")), json.load(f)


def test_update_lora_from_memory_rewrites_its_slot_in_place(llm, adapters):
    """An adapter given in memory serves like the same adapter read from disk; `update_lora` with
    new factors rewrites its device slot in place (the same slot, only the LoRA stacks' buffers
    replaced, nothing compiles), and blocks cached under the old factors are never served again."""
    import jax

    from jpaged import LoRARequest

    jax.monitoring.register_event_duration_secs_listener(_count_compile)
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    request = LoRARequest("trainer", 50, "memory://trainer")
    prompt = random_prompts(np.random.default_rng(5), [40])
    llm.update_lora(request, *_in_memory(adapters, "attn"))
    first = llm.generate(prompt, greedy(6), use_tqdm=False, lora_request=request)[0]
    again = llm.generate(prompt, greedy(6), use_tqdm=False, lora_request=request)[0]
    assert first.outputs[0].token_ids == hf_greedy(adapters["attn"][1], prompt[0], 6)[0]
    assert again.num_cached_tokens > 0
    slot = engine.lora.slots.slot_of[request.lora_int_id]
    before, compiles = jax.tree.leaves(runner.state), (llm.get_metrics()["num_compilations"], _COMPILES[0])

    llm.update_lora(request, *_in_memory(adapters, "all"))  # what a trainer's weight sync does
    after = jax.tree.leaves(runner.state)
    assert all(a is b for i, (a, b) in enumerate(zip(before, after)) if i not in runner._lora_writer.indices)
    written = {runner._lora_writer.keys[k]: after[i] for k, i in enumerate(runner._lora_writer.indices)}
    a, b = engine.lora.adapter(request).weights[(0, "gate_proj")]  # "attn" left the MLP untouched
    np.testing.assert_array_equal(np.asarray(written[(0, "gate_proj", 0)])[slot], a)
    np.testing.assert_array_equal(np.asarray(written[(0, "gate_proj", 1)])[slot], b)
    out = llm.generate(prompt, greedy(6), use_tqdm=False, lora_request=request)[0]
    assert engine.lora.slots.slot_of[request.lora_int_id] == slot
    assert out.num_cached_tokens == 0, "a block computed under the old factors was served"
    assert out.outputs[0].token_ids == hf_greedy(adapters["all"][1], prompt[0], 6)[0]
    assert (llm.get_metrics()["num_compilations"], _COMPILES[0]) == compiles

    tensors, config = _in_memory(adapters, "all")
    with pytest.raises(ValueError, match="'trainer' \\(in memory\\): tensors.*do not fit"):
        llm.update_lora(request, {k: v[:, :1] for k, v in tensors.items()}, config)
    kept = llm.generate(prompt, greedy(6), use_tqdm=False, lora_request=request)[0]
    assert kept.outputs[0].token_ids == out.outputs[0].token_ids and kept.num_cached_tokens > 0
    assert engine.lora.remove("trainer")
    assert_no_leak(llm)


@pytest.mark.slow
def test_n_and_beams_with_an_adapter(llm, adapters):
    from jpaged import BeamSearchParams, SamplingParams

    reqs = requests_of(adapters)
    prompt = random_prompts(np.random.default_rng(4), [8])
    out = llm.generate(prompt, SamplingParams(n=3, temperature=0.0, max_tokens=6, min_tokens=6), use_tqdm=False,
                       lora_request=reqs["mlp"])[0]
    ref = hf_greedy(adapters["mlp"][1], prompt[0], 6)[0]
    assert [c.token_ids for c in out.outputs] == [ref] * 3
    beams = llm.beam_search(prompt, BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True),
                            lora_request=reqs["mlp"])
    assert len(beams[0].sequences) == 2
    assert_no_leak(llm)


def test_bad_adapters_are_value_errors_and_the_engine_serves_on(llm, llama_dir, adapters, tmp_path, qwen2_dir):
    from jpaged import LoRARequest

    prompt = [5, 6, 7]
    good = requests_of(adapters)["all"]
    src = adapters["all"][0]

    def broken(name, config_edit=None, weights: bytes | None = None):
        d = tmp_path / name
        d.mkdir()
        config = json.load(open(os.path.join(src, "adapter_config.json")))
        if config_edit:
            config_edit(config)
        json.dump(config, open(d / "adapter_config.json", "w"))
        data = open(os.path.join(src, "adapter_model.safetensors"), "rb").read()
        (d / "adapter_model.safetensors").write_bytes(data if weights is None else weights)
        return str(d)

    cases = {
        "missing": (str(tmp_path / "nowhere"), "lora_path"),
        "rank": (None, "max_lora_rank"),
        "module": (broken("module", lambda c: c.update(target_modules=["q_proj", "lm_head"])), "target_modules"),
        "corrupt": (broken("corrupt", weights=b"\x00garbage" * 10), "adapter_model.safetensors"),
        "shape": (broken("shape", lambda c: c.update(r=4)), "do not fit"),
    }
    big = tmp_path / "big"
    make_adapter(llama_dir[1], big, r=32, alpha=32, targets=["q_proj"])
    cases["rank"] = (str(big), "max_lora_rank")
    for i, (name, (path, needle)) in enumerate(cases.items()):
        with pytest.raises(ValueError, match=needle):
            llm.generate([prompt], greedy(2), use_tqdm=False, lora_request=LoRARequest(name, 100 + i, path))
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, src)
    out = llm.generate([prompt], greedy(2), use_tqdm=False, lora_request=good)
    assert out[0].outputs[0].token_ids == hf_greedy(adapters["all"][1], prompt, 2)[0]
    assert_no_leak(llm)


def test_lora_request_without_enable_lora(llama_dir, adapters):
    from jpaged import LLM

    plain = LLM(llama_dir[0], num_kv_blocks=32, max_num_seqs=2, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="enable_lora"):
        plain.generate([[4, 5]], greedy(2), use_tqdm=False, lora_request=requests_of(adapters)["all"])
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LLM(llama_dir[0], enable_lora=True, max_loras=4, max_cpu_loras=2)


@pytest.mark.slow
def test_qwen2_one_slot_two_adapters_with_preemption(qwen2_dir, tmp_path):
    """Qwen2 (q/k/v biases), two adapters through one device slot: a request whose adapter has no
    slot waits until the other adapter's requests end, then the slot is refilled (LRU); the pool is
    so small that requests are also preempted (their slot pin released and taken again)."""
    from jpaged import LLM, LoRARequest

    path, base = qwen2_dir
    merged = {name: make_adapter(base, tmp_path / name, r=8, alpha=16, seed=seed,
                                 targets=["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"])
              for name, seed in (("q1", 5), ("q2", 6))}
    llm = LLM(path, enable_lora=True, max_loras=1, max_lora_rank=8, num_kv_blocks=5, block_size=16,
              max_num_seqs=4, max_num_batched_tokens=64, enable_prefix_caching=False)
    reqs = {name: LoRARequest(name, i + 1, str(tmp_path / name)) for i, name in enumerate(merged)}
    names = ["q1", None, "q2", "q1"]
    prompts = random_prompts(np.random.default_rng(6), [20, 18, 22, 9])
    outs = llm.generate(prompts, greedy(16), use_tqdm=False, lora_request=[reqs.get(n) for n in names])
    for name, prompt, out in zip(names, prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(merged.get(name, base), prompt, 16)[0], name
    m = llm.get_metrics()
    assert m["num_preemptions"] > 0 and m["lora_slot_evictions"] > 0
    assert_no_leak(llm)


def test_gather_ragged_and_dense_deltas_agree():
    import jax.numpy as jnp

    from jpaged.models.lora import dense_delta, gather_delta, ragged_delta
    from jpaged.runner.inputs import lora_inputs

    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((13, 16)), jnp.float32)
    a = jnp.asarray(rng.standard_normal((4, 16, 8)), jnp.float32).at[0].set(0)
    b = jnp.asarray(rng.standard_normal((4, 8, 24)), jnp.float32).at[0].set(0)
    slots = rng.integers(0, 4, 13).astype(np.int32)
    inputs = lora_inputs(slots, 4)
    want = np.stack([np.asarray(x[t] @ a[s] @ b[s]) for t, s in enumerate(slots)])
    np.testing.assert_allclose(np.asarray(gather_delta(x, a, b, inputs.slots)), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ragged_delta(x, a, b, inputs)), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dense_delta(x, a, b, jnp.asarray(inputs.slots))), want,
                               rtol=1e-5, atol=1e-5)



@pytest.mark.slow
def test_whole_step_with_lora_compiles_for_tpu(tmp_path):
    """The accelerators' whole step with the LoRA slot stacks and slot inputs compiles for a v5e
    chip (`jpaged.entrypoints.aot.compile_engine`, the TPU compiler's venv, no device): Pallas attention
    and the grouped LoRA matmuls in one executable, for the fewest and most tokens of the plan."""
    import subprocess

    from transformers import LlamaConfig

    from pallas_kernels.aot import venv

    why = venv.missing("tpu")
    if why is not None:
        pytest.skip(why)
    fields = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=128, vocab_size=512, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=2).to_dict()
    fields["architectures"] = ["LlamaForCausalLM"]
    model_json = tmp_path / "config.json"
    model_json.write_text(json.dumps(fields))
    code = f"""
import json
from jpaged.entrypoints import aot
from jpaged.config_resolution import engine_config
from jpaged.loading import hf_checkpoint
mc = hf_checkpoint.model_config(json.load(open({str(model_json)!r})), {str(model_json)!r})
config = engine_config(None, enable_lora=True, max_loras=3, max_lora_rank=16, max_num_seqs=4,
                       max_num_batched_tokens=32, max_model_len=256, block_size=16)
result = aot.compile_engine(mc, config, "v5e", topology="v5e:2x2", shapes="edges")
print("RESULT", json.dumps([[s.name, s.ok, s.error] for s in result.steps]))
"""
    done = subprocess.run([venv.python("tpu"), "-c", code], env=venv.environment("tpu"), capture_output=True,
                          text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = json.loads(done.stdout.split("RESULT ", 1)[1])
    assert steps and all(ok for _, ok, _ in steps), steps


@pytest.mark.slow
def test_server_serves_adapters_by_model_name(llama_dir, adapters, tmp_path):
    """``--lora_modules`` adapters and the base model under their own names, listed in /v1/models;
    adapters loaded and unloaded while serving, behind the API key; OpenAI error bodies."""
    from fastapi.testclient import TestClient

    from jpaged import LLM
    from jpaged.entrypoints.async_engine import AsyncLLMEngine
    from jpaged.entrypoints.lora_adapters import parse_lora_modules
    from jpaged.entrypoints.openai_server import create_app

    llm = LLM(llama_dir[0], enable_lora=True, max_loras=1, max_lora_rank=16, num_kv_blocks=64,
              max_num_seqs=4, max_num_batched_tokens=64)
    prompt = [5, 9, 14, 3]
    reqs = requests_of(adapters)
    expected = {}  # the offline API's text (its tokens the oracle's), which the server must return
    for name, lora, oracle in (("all", reqs["all"], adapters["all"][1]), ("tiny", None, llama_dir[1]),
                               ("attn", reqs["attn"], adapters["attn"][1])):
        out = llm.generate([prompt], greedy(6), use_tqdm=False, lora_request=lora)[0].outputs[0]
        assert out.token_ids == hf_greedy(oracle, prompt, 6)[0]
        expected[name] = out.text
    engine = AsyncLLMEngine(llm.llm_engine)
    modules = parse_lora_modules([f"all={adapters['all'][0]}"])
    app = create_app(engine, served_model_name="tiny", api_key="k", lora_modules=modules)
    auth = {"Authorization": "Bearer k"}
    body = dict(prompt=prompt, max_tokens=6, min_tokens=6, temperature=0)

    def text_of(response):
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]


    with TestClient(app) as client:
        assert client.get("/v1/models").status_code == 401
        assert [m["id"] for m in client.get("/v1/models", headers=auth).json()["data"]] == ["tiny", "all"]
        adapter_text = text_of(client.post("/v1/completions", json=dict(body, model="all"), headers=auth))
        assert adapter_text == expected["all"]
        base_text = text_of(client.post("/v1/completions", json=dict(body, model="tiny"), headers=auth))
        assert base_text == expected["tiny"] and base_text != adapter_text
        missing = client.post("/v1/completions", json=dict(body, model="attn"), headers=auth)
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"

        load = dict(lora_name="attn", lora_path=adapters["attn"][0])
        assert client.post("/v1/load_lora_adapter", json=load).status_code == 401
        assert client.post("/v1/load_lora_adapter", json=load, headers=auth).status_code == 200
        again = client.post("/v1/load_lora_adapter", json=load, headers=auth)
        assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
        bad = client.post("/v1/load_lora_adapter", json=dict(lora_name="bad", lora_path=str(tmp_path / "none")),
                          headers=auth)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
        assert "attn" in [m["id"] for m in client.get("/v1/models", headers=auth).json()["data"]]
        got = text_of(client.post("/v1/completions", json=dict(body, model="attn"), headers=auth))
        assert got == expected["attn"]

        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "attn"}, headers=auth).status_code == 200
        assert client.post("/v1/completions", json=dict(body, model="attn"), headers=auth).status_code == 404
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "attn"}, headers=auth).status_code == 404
        m = engine.call(engine.engine.get_metrics).result(timeout=30)
        assert m["num_free_blocks"] == m["num_total_blocks"] and m["lora_slots_in_use"] == 0
        # the Gateway API Inference Extension's LoRA series (idle: no adapter running or waiting)
        metrics = client.get("/metrics").text
        info = next(line for line in metrics.splitlines() if line.startswith("vllm:lora_requests_info{"))
        assert 'max_lora="1"' in info and 'running_lora_adapters=""' in info and 'waiting_lora_adapters=""' in info


@pytest.mark.slow
def test_tensor_parallel_two_with_adapters(llama_dir, adapters):
    """Over 2 devices (heads and MLP split; the slot stacks split like their layers: B of the
    column-parallel projections on its output axis, A of o/down on its input axis) a mixed batch
    still gives each merged model's tokens."""
    import jax
    from jax.sharding import PartitionSpec as P

    from jpaged import LLM

    llm = LLM(llama_dir[0], tensor_parallel_size=2, enable_lora=True, max_loras=2, max_lora_rank=16,
              num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=128)
    runner = llm.llm_engine.runner
    leaves = jax.tree.leaves(runner.state)
    specs = {runner._lora_writer.keys[k]: leaves[i].sharding.spec for k, i in enumerate(runner._lora_writer.indices)}
    model = ("model",)
    for name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        assert tuple(specs[(0, name, 0)]) in ((), (None, None, None)) and specs[(0, name, 1)] == P(None, None, *model), name
    for name in ("o_proj", "down_proj"):
        assert specs[(0, name, 0)] == P(None, *model, None) and tuple(specs[(0, name, 1)]) in ((), (None, None, None)), name
    reqs = requests_of(adapters)
    names = ["all", None, "mlp"]
    prompts = random_prompts(np.random.default_rng(8), [6, 11, 9])
    outs = llm.generate(prompts, greedy(8), use_tqdm=False, lora_request=[reqs.get(n) for n in names])
    for name, prompt, out in zip(names, prompts, outs):
        oracle = llama_dir[1] if name is None else adapters[name][1]
        assert out.outputs[0].token_ids == hf_greedy(oracle, prompt, 8)[0], name
    assert_no_leak(llm)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_with_adapters(llama_dir, adapters, method):
    """Speculative decoding verifies with the target's adapters (the draft model, without them,
    proposes base-model tokens): a mixed batch still gives each merged model's greedy tokens."""
    from jpaged import LLM

    spec = {"method": method, "num_speculative_tokens": 3}
    spec.update({"prompt_lookup_max": 2} if method == "ngram" else {"model": llama_dir[0]})
    llm = LLM(llama_dir[0], enable_lora=True, max_loras=2, max_lora_rank=16, num_kv_blocks=96, max_num_seqs=4,
              max_num_batched_tokens=128, speculative_config=spec)
    reqs = requests_of(adapters)
    names = ["attn", None, "all"]
    rng = np.random.default_rng(9)
    prompts = [(p * 3)[:14] for p in random_prompts(rng, [5, 4, 6])]  # repeats: ngram drafts something
    outs = llm.generate(prompts, greedy(10), use_tqdm=False, lora_request=[reqs.get(n) for n in names])
    for name, prompt, out in zip(names, prompts, outs):
        oracle = llama_dir[1] if name is None else adapters[name][1]
        assert out.outputs[0].token_ids == hf_greedy(oracle, prompt, 10)[0], (method, name)
    assert llm.get_metrics()["spec_decode_num_draft_tokens"] > 0
    assert_no_leak(llm)
