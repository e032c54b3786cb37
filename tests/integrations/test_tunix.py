"""jpaged as Tunix's rollout engine: `jpaged.integrations.tunix.JpagedRollout` in a real Tunix
GRPO loop (``GRPOLearner`` on ``RLCluster``) on a tiny random Tunix Llama 3, on CPU.

Tunix pins packages the main environment has newer, so it lives in the venv of
``scripts/setup_tunix.sh``; this file runs itself there (``python tests/integrations/test_tunix.py`` prints one
JSON line of results) and the pytest side checks them. A missing venv fails the test with the
setup command; ``JPAGED_SKIP_TUNIX=1`` skips it instead.

Checked: with the same weights (Llama3; Qwen2 and Qwen3 greedy only), jpaged's greedy completions and logprobs equal Tunix's vanilla
rollout (its own sampler on the same NNX model), before training and after every weight sync of
the GRPO loop (the weights must change between syncs, so the check cannot pass on stale ones);
``get_per_token_logps`` equals Tunix's own ``compute_per_token_logps``; the loss is finite and
rewards are reported; after the loop every KV block is free.
"""
import json
import os
import subprocess
import sys

import pytest

TUNIX_DIR = os.environ.get("JPAGED_TUNIX_DIR", os.path.expanduser("~/.cache/jpaged/tunix"))
TUNIX_PYTHON = os.path.join(TUNIX_DIR, "bin", "python")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OPT_OUT = "JPAGED_SKIP_TUNIX"
RESULT_PREFIX = "TUNIX_RESULT "

# --- the part that runs inside the Tunix venv ------------------------------------------------------

PROMPTS = ["abc", "hello", "xyz!", "tunix"]
MAX_TOKENS = 8


def _tokenizer():
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: conftest
    from conftest import byte_tokenizer

    return byte_tokenizer()


def _tiny_llama3(seed: int):
    from tunix.models.llama3 import model as llama3

    return _tiny(llama3, llama3.Llama3, seed)


def _tiny(module, cls, seed: int, **extra):
    """A random tiny Tunix model whose parameters have margins (normal 0.15, norms near 1)."""
    import jax
    from flax import nnx

    config = module.ModelConfig(num_layers=2, vocab_size=256, embed_dim=64, hidden_dim=128, num_heads=4,
                                head_dim=16, num_kv_heads=2, rope_theta=10_000, norm_eps=1e-6, **extra)
    model = cls(config, rngs=nnx.Rngs(seed))
    key = jax.random.key(seed)
    for i, (path, var) in enumerate(nnx.to_flat_state(nnx.state(model, nnx.Param))):
        noise = jax.random.normal(jax.random.fold_in(key, i), var.shape, var.dtype)
        var.set_value(1.0 + 0.1 * noise if path[-2].endswith("norm") else 0.15 * noise)
    return model


def _vanilla(model, tokenizer):
    from tunix.generate import tokenizer_adapter
    from tunix.rl.rollout import base_rollout, vanilla_rollout

    c = model.config
    return vanilla_rollout.VanillaRollout(model, tokenizer_adapter.TokenizerAdapter(tokenizer),
                                          base_rollout.CacheConfig(cache_size=64, num_layers=c.num_layers,
                                                                   num_kv_heads=c.num_kv_heads, head_dim=c.head_dim))


def _greedy_config():
    from tunix.rl.rollout import base_rollout

    return base_rollout.RolloutConfig(max_tokens_to_generate=MAX_TOKENS, max_prompt_length=16, top_p=None,
                                      temperature=0.0, kv_cache_size=64, return_logprobs=True)


def _compare(jpaged_rollout, model, tokenizer) -> dict:
    """Greedy tokens / logprobs / per-token logps of jpaged vs Tunix's vanilla rollout on ``model``."""
    import numpy as np

    vanilla = _vanilla(model, tokenizer)
    cfg = _greedy_config()
    ours, theirs = jpaged_rollout.generate(PROMPTS, cfg), vanilla.generate(PROMPTS, cfg)
    tokens_equal = all(np.array_equal(a, b) for a, b in zip(ours.tokens, theirs.tokens))
    lp_diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)), initial=0.0))
                  for a, b in zip(ours.logprobs, theirs.logprobs))
    pad = jpaged_rollout.pad_id()
    completions = np.full((len(PROMPTS), MAX_TOKENS), pad, np.int32)
    for i, t in enumerate(theirs.tokens):
        completions[i, :len(t)] = t
    prompt = theirs.left_padded_prompt_tokens
    mask = completions != pad
    score_ours = np.asarray(jpaged_rollout.get_per_token_logps(prompt, completions))
    score_theirs = np.asarray(vanilla.get_per_token_logps(prompt, completions))
    return {"tokens_equal": tokens_equal, "prompts_equal": bool(np.array_equal(
                ours.left_padded_prompt_tokens, theirs.left_padded_prompt_tokens)),
            "texts_equal": ours.text == theirs.text, "logprob_diff": lp_diff,
            "score_diff": float(np.max(np.abs(score_ours - score_theirs) * mask)),
            "tokens": [t.tolist() for t in ours.tokens]}


def _other_families(tokenizer) -> dict:
    """Greedy parity with the vanilla rollout for the other mapped families (Qwen2: q/k/v biases;
    Qwen3: q/k norms, tied embeddings)."""
    from tunix.generate import tokenizer_adapter
    from tunix.models.qwen2 import model as qwen2
    from tunix.models.qwen3 import model as qwen3

    from jpaged.integrations.tunix import JpagedRollout

    results = {}
    for name, module, cls, extra in (("Qwen2", qwen2, qwen2.Qwen2, {}),
                                     ("Qwen3", qwen3, qwen3.Qwen3, {"use_tied_embedding": True})):
        model = _tiny(module, cls, 1, **extra)
        rollout = JpagedRollout(rollout_actor=model, tokenizer=tokenizer_adapter.TokenizerAdapter(tokenizer),
                                mesh=None, rollout_config=_greedy_config(), num_kv_blocks=64, block_size=8,
                                max_num_seqs=16)
        results[name] = _compare(rollout, model, tokenizer)
    return results


def run_in_tunix_venv() -> dict:
    import functools

    import jax
    import numpy as np
    import optax
    from flax import nnx
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    from jpaged.integrations.tunix import JpagedRollout

    tokenizer = _tokenizer()
    actor, reference = _tiny_llama3(0), _tiny_llama3(0)
    syncs, trainer = [], {}

    class CheckedRollout(JpagedRollout):
        """Compares with the vanilla rollout on the trainer's model after every weight sync."""

        def update_params(self, params, filter_types=None):
            super().update_params(params, filter_types)
            model = trainer["model"]
            with jax.transfer_guard("allow"):  # sync_weights forbids host transfers on CPU
                flat = [np.asarray(v) for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param))]
                syncs.append({"compare": _compare(self, model, tokenizer),
                              "param_sum": float(sum(np.abs(v).sum() for v in flat))})

    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)  # Tunix shards by hand
    Role = rl_cluster_lib.Role
    rollout_config = base_rollout.RolloutConfig(max_tokens_to_generate=MAX_TOKENS, max_prompt_length=16,
                                                temperature=1.0, top_p=1.0, kv_cache_size=64, seed=0)
    cluster = rl_cluster_lib.RLCluster(
        actor=actor, reference=reference, tokenizer=tokenizer,
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={Role.ACTOR: mesh, Role.REFERENCE: mesh, Role.ROLLOUT: mesh},
            rollout_engine=functools.partial(CheckedRollout, num_kv_blocks=64, block_size=8, max_num_seqs=16),
            offload_to_cpu=False,
            training_config=rl_cluster_lib.RLTrainingConfig(
                actor_optimizer=optax.adam(3e-3), eval_every_n_steps=100, max_steps=3,
                mini_batch_size=2, train_micro_batch_size=2),
            rollout_config=rollout_config))
    trainer["model"] = cluster.actor_trainer.model
    initial = _compare(cluster.rollout, trainer["model"], tokenizer)

    rewards = []

    def reward_fn(prompts, completions, **kwargs):  # favours ASCII letters
        scores = [sum(ch.isascii() and ch.isalpha() for ch in c) / max(1, len(c)) for c in completions]
        rewards.extend(scores)
        return scores

    learner = grpo_learner.GRPOLearner(rl_cluster=cluster, reward_fns=reward_fn,
                                       algo_config=grpo_learner.GRPOConfig(num_generations=4, num_iterations=1,
                                                                           beta=0.04))
    dataset = [{"prompts": np.array(PROMPTS[i:i + 2])} for i in range(0, 4, 2)] * 2  # batches of 2
    learner.train(dataset)
    logged = cluster._rl_metrics_logger  # noqa: SLF001  (RLCluster keeps its logger private)
    losses = [float(x) for x in logged.get_metric_history("actor", "loss", "train")]
    reward_means = [float(x) for x in logged.get_metric_history("rewards", "score/mean", "train")]
    metrics = cluster.rollout.llm.get_metrics()
    return {"families": _other_families(tokenizer), "initial": initial, "syncs": syncs, "rewards": rewards, "reward_means": reward_means,
            "losses": losses,
            "free_blocks": metrics["num_free_blocks"], "total_blocks": metrics["num_total_blocks"],
            "global_steps": cluster.global_steps}


LORA_MODULES = ".*q_proj|.*k_proj|.*v_proj|.*o_proj|.*gate_proj|.*up_proj|.*down_proj"


def _lora_policy(base, rank: int, alpha: float):
    """``base`` with qwix LoRA on every projection (as Tunix's examples apply it), B random so the
    adapter changes the outputs from the first step (qwix starts B at zero)."""
    import jax
    import qwix
    from flax import nnx

    inputs = {"input_tokens": jax.numpy.ones((1, 8), jax.numpy.int32),
              "positions": jax.numpy.arange(8, dtype=jax.numpy.int32)[None], "cache": None,
              "attention_mask": jax.numpy.ones((1, 8, 8), bool)}
    model = qwix.apply_lora_to_model(base, qwix.LoraProvider(module_path=LORA_MODULES, rank=rank, alpha=alpha),
                                     rngs=nnx.Rngs(1), **inputs)
    key = jax.random.key(7)
    for i, (path, var) in enumerate(nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))):
        if path[-1].endswith("_lora_b"):
            var.set_value(0.2 * jax.random.normal(jax.random.fold_in(key, i), var.shape, var.dtype))
    return model


def run_lora_in_tunix_venv() -> dict:
    """GRPO on a qwix LoRA policy: Tunix trains only the LoRA factors and syncs them with
    ``update_params(lora_state, (nnx.LoRAParam,))``; after each sync jpaged (the base weights plus
    the policy as one in-memory adapter) must equal the vanilla rollout on the trainer's model."""
    import functools

    import jax
    import numpy as np
    import optax
    from flax import nnx
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    from jpaged.integrations.tunix import JpagedRollout

    tokenizer = _tokenizer()
    reference = _tiny_llama3(0)
    actor = _lora_policy(_tiny_llama3(0), rank=4, alpha=2.0)  # scale 0.5: a wrong scale would show
    syncs, trainer = [], {}

    def sums(model, kind):
        return float(sum(np.abs(np.asarray(v)).sum() for _, v in nnx.to_flat_state(nnx.state(model, kind))))

    class CheckedRollout(JpagedRollout):
        def update_params(self, params, filter_types=None):
            with jax.transfer_guard("allow"):
                sent = sorted({type(v).__name__ for _, v in nnx.to_flat_state(params)})
            compilations = self.llm.get_metrics()["num_compilations"]
            super().update_params(params, filter_types)
            added = self.llm.get_metrics()["num_compilations"] - compilations
            model = trainer["model"]
            with jax.transfer_guard("allow"):  # sync_weights forbids host transfers on CPU
                frozen = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))
                syncs.append({"compare": _compare(self, model, tokenizer), "compilations_added": added,
                              "compilations": self.llm.get_metrics()["num_compilations"],
                              "filter_types": [getattr(t, "__name__", str(t)) for t in filter_types or ()],
                              "sent": sent, "lora_sum": sums(model, nnx.LoRAParam), "base_sum": sums(model, frozen)})

    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    Role = rl_cluster_lib.Role
    cluster = rl_cluster_lib.RLCluster(
        actor=actor, reference=reference, tokenizer=tokenizer,
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={Role.ACTOR: mesh, Role.REFERENCE: mesh, Role.ROLLOUT: mesh},
            rollout_engine=functools.partial(CheckedRollout, num_kv_blocks=64, block_size=8, max_num_seqs=16),
            offload_to_cpu=False,
            training_config=rl_cluster_lib.RLTrainingConfig(
                actor_optimizer=optax.adam(3e-2), eval_every_n_steps=100, max_steps=3,
                mini_batch_size=2, train_micro_batch_size=2),
            rollout_config=base_rollout.RolloutConfig(max_tokens_to_generate=MAX_TOKENS, max_prompt_length=16,
                                                      temperature=1.0, top_p=1.0, kv_cache_size=64, seed=0)))
    trainer["model"] = cluster.actor_trainer.model
    initial = _compare(cluster.rollout, trainer["model"], tokenizer)
    base_tokens = [t.tolist() for t in _vanilla(reference, tokenizer).generate(PROMPTS, _greedy_config()).tokens]
    engine = cluster.rollout.llm.llm_engine

    def reward_fn(prompts, completions, **kwargs):  # favours ASCII letters
        return [sum(ch.isascii() and ch.isalpha() for ch in c) / max(1, len(c)) for c in completions]

    learner = grpo_learner.GRPOLearner(rl_cluster=cluster, reward_fns=reward_fn,
                                       algo_config=grpo_learner.GRPOConfig(num_generations=4, num_iterations=1,
                                                                           beta=0.04))
    learner.train([{"prompts": np.array(PROMPTS[i:i + 2])} for i in range(0, 4, 2)] * 2)
    logged = cluster._rl_metrics_logger  # noqa: SLF001  (RLCluster keeps its logger private)
    metrics = cluster.rollout.llm.get_metrics()
    return {"initial": initial, "base_tokens": base_tokens, "syncs": syncs,
            "losses": [float(x) for x in logged.get_metric_history("actor", "loss", "train")],
            "global_steps": cluster.global_steps, "max_lora_rank": engine.config.max_lora_rank,
            "lora_version": engine.lora.versions[cluster.rollout._lora_request.lora_int_id],  # noqa: SLF001
            "weights_version": engine.weights_version, "lora_slots_in_use": metrics["lora_slots_in_use"],
            "free_blocks": metrics["num_free_blocks"], "total_blocks": metrics["num_total_blocks"]}


# --- the pytest side (main environment) ------------------------------------------------------------

def _run_in_venv(*args: str):
    if not os.path.exists(TUNIX_PYTHON):
        why = f"the Tunix venv is missing ({TUNIX_PYTHON}): run `bash scripts/setup_tunix.sh`"
        if os.environ.get(OPT_OUT) == "1":
            pytest.skip(why)
        pytest.fail(f"{why} (or set {OPT_OUT}=1 to skip the Tunix test)")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    env.pop("XLA_FLAGS", None)  # one CPU device, as a single-host trainer
    proc = subprocess.run([TUNIX_PYTHON, os.path.abspath(__file__), *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        pytest.fail(f"the Tunix run failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len(RESULT_PREFIX):])


def _assert_matches(compare, when):
    assert compare["tokens_equal"], f"{when}: greedy tokens differ from Tunix's vanilla rollout"
    assert compare["prompts_equal"] and compare["texts_equal"], when
    assert compare["logprob_diff"] < 1e-4, (when, compare["logprob_diff"])
    assert compare["score_diff"] < 1e-4, (when, compare["score_diff"])


@pytest.mark.slow  # ~2 minutes: Tunix compiles its trainer, sampler and reference model
def test_grpo_loop_with_jpaged_rollout():
    result = _run_in_venv()
    _assert_matches(result["initial"], "before training")
    assert any(len(t) > 0 for t in result["initial"]["tokens"])
    syncs = result["syncs"]
    assert len(syncs) == result["global_steps"] >= 2, (len(syncs), result["global_steps"])
    for i, sync in enumerate(syncs):
        _assert_matches(sync["compare"], f"after weight sync {i + 1}")
    sums = [s["param_sum"] for s in syncs]
    assert len(set(sums)) == len(sums), f"the trainer's weights did not change between syncs: {sums}"
    assert result["rewards"] and result["reward_means"], "no rewards were computed / reported"
    assert len(set(result["rewards"])) > 1, "constant rewards: GRPO would not move the weights"
    assert result["losses"] and all(abs(x) < float("inf") for x in result["losses"]), result["losses"]
    assert result["free_blocks"] == result["total_blocks"], "KV blocks leaked"
    for family, compare in result["families"].items():
        _assert_matches(compare, family)


@pytest.mark.slow  # ~2 minutes, as above
def test_grpo_loop_with_a_lora_policy():
    """Only the qwix LoRA factors train; each sync rewrites the engine's adapter in place."""
    result = _run_in_venv("lora")
    _assert_matches(result["initial"], "before training")
    assert result["initial"]["tokens"] != result["base_tokens"], "the adapter changed no token"
    assert result["max_lora_rank"] == 4
    syncs = result["syncs"]
    assert len(syncs) == result["global_steps"] >= 2, (len(syncs), result["global_steps"])
    for i, sync in enumerate(syncs):
        _assert_matches(sync["compare"], f"after LoRA sync {i + 1}")
        assert sync["filter_types"] == ["LoRAParam"] and sync["sent"] == ["LoRAParam"], sync
        assert sync["compilations_added"] == 0, f"sync {i + 1} compiled"
    assert len({s["compilations"] for s in syncs}) == 1, [s["compilations"] for s in syncs]
    lora_sums, base_sums = [s["lora_sum"] for s in syncs], [s["base_sum"] for s in syncs]
    assert len(set(lora_sums)) == len(lora_sums), f"the LoRA factors did not change between syncs: {lora_sums}"
    assert len(set(base_sums)) == 1, f"the frozen base weights changed: {base_sums}"
    assert result["weights_version"] == 0, "a LoRA-only sync reloaded the base weights"
    assert result["lora_version"] == 1 + len(syncs)  # registered once, replaced at every sync
    assert result["losses"] and all(abs(x) < float("inf") for x in result["losses"]), result["losses"]
    assert result["free_blocks"] == result["total_blocks"], "KV blocks leaked"
    assert result["lora_slots_in_use"] == 0


if __name__ == "__main__":
    run = run_lora_in_tunix_venv if sys.argv[1:] == ["lora"] else run_in_tunix_venv
    print(RESULT_PREFIX + json.dumps(run()), flush=True)
