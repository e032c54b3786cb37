"""The engine inside a training loop: update_weights, sleep / wake_up, score, logprobs, pause.

Two tiny random Llamas (different seeds) saved by transformers: the engine starts on the first,
takes the second's weights in each accepted form, and must then agree with transformers on the
second, without compiling anything new.
"""
import json
import urllib.error
import urllib.request

import jax
import numpy as np
import pytest

from conftest import COMMON, hf_greedy, random_prompts
from jpaged import LLM, SamplingParams
from test_model_families import FAMILIES, RECURRENT, family
from test_model_families import engine as family_engine
from test_models_paper import gpt2_dir, opt_dir  # noqa: F401 (fixtures)
from jpaged import testing

ENGINE = dict(num_kv_blocks=64, block_size=8, max_model_len=256)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8, logprobs=0)


@pytest.fixture(scope="module")
def second_llama(tmp_path_factory):
    """A Llama of the fixture's shape with other random weights: (path, transformers model)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(LlamaConfig(num_key_value_heads=2, tie_word_embeddings=False,
                                                         **COMMON)).eval()
    path = str(tmp_path_factory.mktemp("llama_b"))
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir[0], **ENGINE)


def hf_state_dict(model) -> dict:
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


def jit_cache_sizes(runner) -> int:
    """Executables the runner's jitted functions hold (a recompilation adds one)."""
    fns = [runner._window] + ([runner._step] if runner.pieces is None else
                              [runner._embed, runner._take_rows, runner._head, runner._sample,
                               *runner._layers.values()])
    return sum(f._cache_size() for f in fns)


def greedy_tokens(llm, prompt):
    return llm.generate([prompt], GREEDY, use_tqdm=False)[0]


def assert_serves(llm, hf_model, prompt):
    out = greedy_tokens(llm, prompt)
    assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, 8)[0]
    return out


PROMPT = list(range(5, 30))


@pytest.mark.parametrize("form", ["path", "hf_dict", "jax_on_other_devices",
                                  pytest.param("nnx_state", marks=pytest.mark.slow)])
def test_update_weights_serves_the_new_model_without_compiling(llm, llama_dir, second_llama, form):
    engine = llm.llm_engine
    assert_serves(llm, llama_dir[1], PROMPT)  # old weights, and PROMPT's blocks now in the prefix cache
    compilations, executables = llm.get_metrics()["num_compilations"], jit_cache_sizes(engine.runner)
    if form == "path":
        weights = second_llama[0]
    elif form == "hf_dict":
        weights = hf_state_dict(second_llama[1])
    elif form == "jax_on_other_devices":  # a trainer's arrays: split over two other devices
        mesh = jax.sharding.Mesh(np.array(jax.devices()[2:4]), ("fsdp",))
        split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
        weights = {k: jax.device_put(v, split if v.shape[0] % 2 == 0 else split.with_spec(
            jax.sharding.PartitionSpec())) for k, v in hf_state_dict(second_llama[1]).items()}
    else:
        other = LLM(second_llama[0], **ENGINE)
        weights = testing.model_state(other)
    llm.update_weights(weights)
    out = assert_serves(llm, second_llama[1], PROMPT)
    assert out.num_cached_tokens == 0, "a prefix-cache hit across a weight update"
    assert llm.get_metrics()["num_compilations"] == compilations
    assert jit_cache_sizes(engine.runner) == executables
    for leaf in jax.tree.leaves(testing.model_state(engine)):  # on the engine's own devices
        assert leaf.sharding.device_set == {jax.devices()[0]}
    again = greedy_tokens(llm, PROMPT)
    assert again.num_cached_tokens > 0  # the cache works again with the new weights
    llm.update_weights(llama_dir[0])  # back, for the next case
    assert_serves(llm, llama_dir[1], PROMPT)
    m = llm.get_metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"]


def test_update_donates_only_the_buffers_the_engine_owns(llm, llama_dir, second_llama):
    """The new weights are written into the old ones' buffers where the engine made them; a
    model given to ``LLM.from_model`` keeps its arrays (the caller's) through every update."""
    from flax import nnx

    runner = llm.llm_engine.runner
    llm.update_weights(hf_state_dict(second_llama[1]))  # the engine's own buffers from here on
    old = {p: x for p, x in zip(runner.weight_targets.paths, jax.tree.leaves(runner.state))}
    llm.update_weights(llama_dir[0])
    assert all(old[p].is_deleted() for p in runner.weight_targets.param_paths)
    assert_serves(llm, llama_dir[1], PROMPT)
    mine = nnx.merge(runner.graphdef, jax.tree.map(lambda x: x.copy(), runner.state))
    given = jax.tree.leaves(nnx.state(mine))
    shared = LLM.from_model(mine, **ENGINE)
    for weights in (second_llama[0], hf_state_dict(second_llama[1])):
        shared.update_weights(weights)
        assert not any(x.is_deleted() for x in given)
    assert_serves(shared, second_llama[1], PROMPT)


@pytest.mark.slow
def test_other_dtype_is_cast(llm, llama_dir):
    import ml_dtypes

    weights = {k: v.astype(ml_dtypes.bfloat16) for k, v in hf_state_dict(llama_dir[1]).items()}
    llm.update_weights(weights)
    leaves = jax.tree.leaves(testing.model_state(llm))
    assert all(x.dtype != ml_dtypes.bfloat16 for x in leaves)
    runner = llm.llm_engine.runner
    table = np.asarray(dict(zip(runner.weight_targets.paths, leaves))[("embed_tokens", "embedding")])
    np.testing.assert_array_equal(table, weights["model.embed_tokens.weight"].astype(np.float32))
    llm.update_weights(llama_dir[0])
    assert_serves(llm, llama_dir[1], PROMPT)


def test_mismatches_raise_and_old_weights_serve(llm, llama_dir):
    good = hf_state_dict(llama_dir[1])
    missing = dict(good)
    missing.pop("model.layers.1.mlp.up_proj.weight")
    extra = dict(good, **{"model.layers.9.mlp.up_proj.weight": good["model.layers.1.mlp.up_proj.weight"]})
    shape = dict(good, **{"model.layers.0.self_attn.q_proj.weight": np.zeros((64, 32), np.float32)})
    zeros = {k: np.zeros_like(v) for k, v in good.items()}
    zeros["lm_head.weight"] = np.zeros((3, 3), np.float32)  # checked before any weight is placed
    expected = assert_serves(llm, llama_dir[1], PROMPT).outputs[0].token_ids
    for weights, name in [(missing, "model.layers.1.mlp.up_proj.weight"), (extra, "model.layers.9"),
                          (shape, "model.layers.0.self_attn.q_proj.weight"), (zeros, "lm_head.weight"),
                          ("/nonexistent/dir", "/nonexistent/dir"), (42, "weights")]:
        with pytest.raises(ValueError, match=name.replace(".", r"\.")):
            llm.update_weights(weights)
        assert greedy_tokens(llm, PROMPT).outputs[0].token_ids == expected


def test_refused_with_requests_in_flight(llm, llama_dir):
    engine = llm.llm_engine
    engine.add_request("inflight", PROMPT, SamplingParams(max_tokens=4))
    try:
        with pytest.raises(RuntimeError, match="in flight"):
            llm.update_weights(llama_dir[0])
        with pytest.raises(RuntimeError, match="in flight"):
            llm.sleep()
    finally:
        engine.abort_request("inflight")
    assert_serves(llm, llama_dir[1], PROMPT)


@pytest.mark.slow
def test_int8_engine_quantizes_again(llama_dir, second_llama):
    llm = LLM(llama_dir[0], quantization="int8", **ENGINE)
    reference = LLM(second_llama[0], quantization="int8", **ENGINE)
    compilations = llm.get_metrics()["num_compilations"]
    greedy_tokens(llm, PROMPT)
    compilations = llm.get_metrics()["num_compilations"]
    llm.update_weights(hf_state_dict(second_llama[1]))
    assert greedy_tokens(llm, PROMPT).outputs[0].token_ids == greedy_tokens(reference, PROMPT).outputs[0].token_ids
    assert llm.get_metrics()["num_compilations"] == compilations


def live_bytes() -> int:
    """Bytes of JAX's live arrays, each buffer once (on the CPU an array may alias another's)."""
    buffers = {}
    for x in jax.live_arrays():
        for shard in x.addressable_shards:
            buffers[shard.data.unsafe_buffer_pointer()] = shard.data.nbytes
    return sum(buffers.values())


def test_sleep_frees_the_device_and_wake_up_restores(llm, llama_dir, second_llama):
    engine = llm.llm_engine
    before = greedy_tokens(llm, PROMPT)
    compilations, executables = llm.get_metrics()["num_compilations"], jit_cache_sizes(engine.runner)
    awake = live_bytes()
    pool_bytes = sum(x.nbytes for layer in testing.device_kv(engine).caches for x in layer)
    model_bytes = sum(x.nbytes for x in jax.tree.leaves(testing.model_state(engine)))
    llm.sleep(level=1)
    # the pool and every leaf of the model left the device: nothing of the engine's stays behind
    # (no view of a host copy, no old buffer held by a closure, a cache or the last step's outputs)
    assert awake - live_bytes() >= pool_bytes + model_bytes
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate([PROMPT], GREEDY, use_tqdm=False)
    with pytest.raises(RuntimeError, match="asleep"):
        llm.sleep()
    llm.wake_up()
    assert live_bytes() <= awake  # the same pool and weights again, and nothing of before
    after = greedy_tokens(llm, PROMPT)
    assert after.outputs[0].token_ids == before.outputs[0].token_ids
    assert after.num_cached_tokens == 0  # the pool was freed: nothing cached survives
    assert llm.get_metrics()["num_compilations"] == compilations
    assert jit_cache_sizes(engine.runner) == executables
    llm.sleep(level=2)
    with pytest.raises(ValueError, match="update_weights"):
        llm.wake_up()
    llm.update_weights(second_llama[0])
    llm.wake_up()
    assert_serves(llm, second_llama[1], PROMPT)
    llm.update_weights(llama_dir[0])


def hf_log_softmax(model, tokens):
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits, -1).numpy()


@pytest.mark.parametrize("family", ["llama_dir", pytest.param("qwen2_dir", marks=pytest.mark.slow)])
def test_score_and_sampled_logprobs_equal_transformers(family, request):
    """Chunked prefill (24 tokens a step), a small pool (preemption), prefix caching on."""
    path, hf_model = request.getfixturevalue(family)
    llm = LLM(path, num_kv_blocks=14, block_size=8, max_model_len=256, max_num_batched_tokens=24)
    assert_raw_logprobs_equal_transformers(llm, hf_model)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES) + ["gpt2_dir", "opt_dir", "tied_llama_dir"])
def test_raw_logprobs_equal_transformers_in_every_family(name, request, tmp_path_factory):
    """Every other family the engine serves (tests/models/test_model_families.py's tiny random models:
    windows, soft caps, +1 norms, experts; GPT-2, OPT, tied embeddings), in its small pool with
    chunked prefill: sampled-token and scored logprobs equal transformers' log_softmax."""
    if name in FAMILIES:
        hf_model = family(tmp_path_factory, name)[1]
        llm = family_engine(tmp_path_factory, name, max_num_batched_tokens=24)
    else:
        path, hf_model = request.getfixturevalue(name)
        llm = LLM(path, num_kv_blocks=14, block_size=8, max_model_len=256, max_num_batched_tokens=24)
    # Linear-attention layers: the engine runs the gated delta rule token by token, transformers'
    # prefill its chunked form; in float32 the two differ by up to ~2e-5 in a logprob (transformers'
    # own float32 differs from its float64 by up to 8e-6 on this model).
    assert_raw_logprobs_equal_transformers(llm, hf_model, atol=3e-5 if name in RECURRENT else 1e-5)


def assert_raw_logprobs_equal_transformers(llm, hf_model, atol=1e-5):
    """Sampled (temperature 1) completions of four prompts behind a cached prefix, in a pool that
    preempts: their ``logprobs=0`` values and ``score`` equal transformers' within ``atol``."""
    rng = np.random.default_rng(3)
    prompts = random_prompts(rng, [40, 9, 30, 17])
    llm.generate(prompts[:1], SamplingParams(max_tokens=1), use_tqdm=False)  # a cached prefix to (not) use
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=20, logprobs=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.get_metrics()["num_preemptions"] > 0
    completions = [o.outputs[0].token_ids for o in outs]
    scores = llm.score(prompts, completions)
    for prompt, completion, out, score in zip(prompts, completions, outs, scores):
        ref = hf_log_softmax(hf_model, prompt + completion)
        expected = [ref[len(prompt) - 1 + i, t] for i, t in enumerate(completion)]
        np.testing.assert_allclose(score, expected, atol=atol)
        sampled = [lp[t] for lp, t in zip(out.outputs[0].logprobs, completion)]
        assert all(len(lp) == 1 for lp in out.outputs[0].logprobs)  # logprobs=0: the sampled token's only
        np.testing.assert_allclose(sampled, expected, atol=atol)
    # alone, its steps have other row counts than in the batch: where this machine's measured kernel
    # choice differs between the two row classes (C++ or XLA), a float32 logprob moves by a few ulps
    assert llm.score(prompts[1], completions[1]) == pytest.approx(scores[1], abs=atol)
    m = llm.get_metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"]


def test_score_rejects_bad_input(llm):
    for args, name in [(([1, 2], []), "completion_token_ids"), (([[1, 2]], [[3], [4]]), "completion_token_ids"),
                       (([[1, "a"]], [[3]]), "prompt_token_ids"), (([5], [999]), "999")]:
        with pytest.raises(ValueError, match=name):
            llm.score(*args)
    m = llm.get_metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"]


def test_processed_logprobs_are_of_the_sampled_distribution(llama_dir):
    """``logprobs_mode="processed"`` (vLLM's ``processed_logprobs`` too): temperature and top-k applied."""
    import torch

    with pytest.raises(ValueError, match="logprobs_mode"):
        LLM(llama_dir[0], logprobs_mode="scaled", **ENGINE)
    llm = LLM(llama_dir[0], logprobs_mode="processed", **ENGINE)
    assert llm.llm_engine.config.logprobs_mode == "processed_logprobs"
    prompt = random_prompts(np.random.default_rng(4), [12])[0]
    out = llm.generate([prompt], SamplingParams(temperature=0.5, top_k=5, seed=1, max_tokens=6, logprobs=0,
                                                ignore_eos=True), use_tqdm=False)[0].outputs[0]
    with torch.no_grad():
        logits = llama_dir[1](torch.tensor([prompt + out.token_ids])).logits[0].float() / 0.5
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = logits[len(prompt) - 1 + i]
        row = torch.where(row < torch.topk(row, 5).values[-1], -torch.inf, row)
        assert entry[token] == pytest.approx(torch.log_softmax(row, -1)[token].item(), abs=1e-5)


# The async engine and the server ----------------------------------------------------------------------
def post(url, path, body=None, key="sk-train"):
    request = urllib.request.Request(url + path, data=json.dumps(body or {}).encode(), method="POST",
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@pytest.fixture(scope="module")
def server(llm):
    from test_server import start_server

    from jpaged.entrypoints.async_engine import AsyncLLMEngine
    from jpaged.entrypoints.openai_server import create_app

    engine = AsyncLLMEngine(llm.llm_engine)
    apps = {flag: create_app(engine, served_model_name="tiny", api_key="sk-train", enable_weight_updates=flag)
            for flag in (True, False)}
    servers = {flag: start_server(app) for flag, app in apps.items()}
    yield engine, servers[True][2], servers[False][2]
    for s, thread, _ in servers.values():
        s.should_exit = True
        thread.join(30)


def test_pause_waits_or_aborts_and_resume_goes_on(server):
    import asyncio

    engine = server[0]

    async def scenario():
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        stream = await engine.add("long", PROMPT, params)
        await engine.pause_generation()
        assert engine.is_paused
        with pytest.raises(RuntimeError, match="in flight"):
            await engine.sleep()
        frozen = engine.engine.requests["long"].seqs[0].num_tokens
        await asyncio.sleep(0.3)
        assert engine.engine.requests["long"].seqs[0].num_tokens == frozen  # waits
        await engine.resume_generation()
        last = None
        async for last in stream:
            pass
        assert last.outputs[0].finish_reason == "length" and len(last.outputs[0].token_ids) == 200
        stream = await engine.add("aborted", PROMPT, params)
        await engine.pause_generation(abort=True)
        async for last in stream:
            pass
        assert last.outputs[0].finish_reason == "abort"
        await engine.resume_generation()

    asyncio.run(scenario())
    m = engine.engine.get_metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"]


def test_server_training_routes(server, llama_dir, second_llama):
    engine, url, url_without_updates = server
    assert post(url, "/pause", key=None)[0] == 401
    status, body = post(url_without_updates, "/update_weights", {"path": second_llama[0]})
    assert status == 403 and "--enable_weight_updates" in body["error"]["message"]
    assert post(url, "/update_weights", {"path": "/nonexistent"})[0] == 400
    assert post(url, "/update_weights", {"weights": 1})[0] == 400
    assert post(url, "/sleep?level=3")[0] == 400
    assert post(url, "/update_weights", {"path": second_llama[0]}) == (200, {"status": "ok"})
    assert post(url, "/sleep?level=1")[0] == 200
    status, body = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    assert status == 503 and "asleep" in body["error"]["message"]
    assert post(url, "/wake_up")[0] == 200
    status, body = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                                 "ignore_eos": True})
    assert status == 200 and body["choices"][0]["text"] is not None
    assert post(url, "/pause")[0] == 200 and engine.is_paused
    assert post(url, "/resume")[0] == 200 and not engine.is_paused
    assert post(url, "/update_weights", {"path": llama_dir[0]})[0] == 200


@pytest.mark.slow
def test_data_parallel_replicas_all_update_and_sleep(llama_dir, second_llama):
    llm = LLM(llama_dir[0], data_parallel_size=2, **ENGINE)
    llm.update_weights(second_llama[0])
    prompts = [PROMPT, PROMPT[:20]]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(second_llama[1], p, 8)[0] for p in prompts]
    llm.sleep(1)
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    llm.wake_up()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in outs]


def test_draft_model_weights_update_too(llm, llama_dir, second_llama):
    """The target as its own draft: after a target-only update the draft still proposes from the
    old weights (outputs stay the new target's, fewer proposals accepted); with ``draft_weights``
    the two agree again (every proposal accepted)."""
    spec = {"method": "draft_model", "model": llama_dir[0], "num_speculative_tokens": 3}
    spec_llm = LLM(llama_dir[0], speculative_config=spec, **ENGINE)
    current = llama_dir

    def acceptance(prompt):
        before = spec_llm.get_metrics()
        out = assert_serves(spec_llm, current[1], prompt)
        after = spec_llm.get_metrics()
        drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
        return out, (after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]) / drafted

    assert acceptance(PROMPT)[1] == 1.0
    compilations = spec_llm.get_metrics()["num_compilations"]
    with pytest.raises(ValueError, match="draft_weights: .*missing"):  # the draft's checked first
        spec_llm.update_weights(second_llama[0], draft_weights={"model.norm.weight": np.ones(64, np.float32)})
    assert acceptance(PROMPT)[1] == 1.0  # neither changed
    current = second_llama
    spec_llm.update_weights(second_llama[0])
    assert acceptance(PROMPT)[1] < 1.0  # the new target's tokens, the old draft's proposals
    spec_llm.update_weights(second_llama[0], draft_weights=hf_state_dict(second_llama[1]))
    out, rate = acceptance(PROMPT)
    assert rate == 1.0 and out.num_cached_tokens == 0
    spec_llm.sleep(level=2)  # the draft's weights wait on the host; the target's come with the update
    spec_llm.update_weights(llama_dir[0], draft_weights=llama_dir[0])
    spec_llm.wake_up()
    current = llama_dir
    assert acceptance(list(range(40, 70)))[1] == 1.0
    assert spec_llm.get_metrics()["num_compilations"] == compilations
    m = spec_llm.get_metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"]
    with pytest.raises(ValueError, match="draft_weights: the engine has no draft model"):
        llm.update_weights(llama_dir[0], draft_weights=llama_dir[0])
