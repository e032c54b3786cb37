"""jpaged as a rollout engine of Tunix, Google's JAX post-training library (``google-tunix``).

``RLCluster(cluster_config=ClusterConfig(rollout_engine=JpagedRollout, ...))`` constructs it as
``JpagedRollout(rollout_actor=<the trainer's NNX model>, tokenizer=<Tunix's TokenizerAdapter>,
mesh=<the rollout mesh>, rollout_config=<RolloutConfig>)``; engine settings of ``LLM(...)`` go
through ``functools.partial(JpagedRollout, num_kv_blocks=..., memory_utilization=...)``.

The Tunix model's parameters are renamed to Hugging Face names (`tunix_to_hf`) and loaded into
jpaged's own model of the family (`LlamaForCausalLM` covers Tunix's ``Llama3``, ``Qwen2`` and
dense ``Qwen3``; Gemma and the mixture-of-experts Qwen3 are not mapped). The engine runs on the
same devices as the trainer: on an accelerator its KV pool takes ``memory_utilization`` of the
device's memory minus what is already in use (the trainer's arrays), so the trainer keeps the rest.

A LoRA policy (qwix ``LoraProvider``: ``nnx.LoRAParam`` factors beside the frozen weights) is served
as the base weights plus one in-memory adapter (`jpaged.integrations.qwix_lora`), which every
``generate`` and ``get_per_token_logps`` runs under; Tunix's LoRA-only weight sync
(``update_params(lora_state, (nnx.LoRAParam,))``) rewrites that adapter's device slot in place.

Behaviour follows Tunix's vanilla rollout: a prompt is ``bos + encode(text)``; ``top_p=None`` (or
``temperature=0``) is greedy; a completion stops at ``eos_tokens`` (default: the tokenizer's eos),
and its tokens exclude that eos; prompts are left-padded to ``max_prompt_length`` (to the next
power of two when one is longer). Identical prompts of a batch (GRPO's ``num_generations``
copies) become one request with ``n`` samples, which share the prompt's KV blocks.

This module imports Tunix; it runs in the Tunix venv of ``scripts/setup_tunix.sh``.
"""
import inspect

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.rl.rollout import base_rollout

from jpaged import LLM, LoRARequest, SamplingParams
from jpaged.integrations.qwix_lora import lora_factors, module_rank_alpha, qwix_lora_rules, qwix_lora_to_peft
from jpaged.integrations.tunix_params import is_lora_factor, tunix_to_hf
from jpaged.loading.model_loader import build_model
from jpaged.models import ModelConfig
from jpaged.utils import next_power_of_two

POLICY_ADAPTER = "tunix_policy"  # the LoRARequest name of a LoRA policy's adapter
# Tunix class name -> the Hugging Face architecture and model_type of jpaged's model of the family
FAMILIES = {
    "Llama3": ("LlamaForCausalLM", "llama"),
    "Qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "Qwen3": ("Qwen3ForCausalLM", "qwen3"),
}


def _rope_theta(model) -> float:
    """The rope base the Tunix model computes with. Tunix 0.1.7's Llama3 attention calls
    ``apply_rope`` without the config's ``rope_theta``, so it runs at that function's default;
    the rollout must compute what the trainer computes. (qwix gives a LoRA model a subclass made
    outside Tunix's module: the module is the first in the class's MRO that defines a family.)"""
    module = next((m for m in map(inspect.getmodule, type(model).__mro__) if hasattr(m, "Attention")), None)
    attention = getattr(module, "Attention", None)
    apply_rope = getattr(module, "apply_rope", None)
    if attention is not None and apply_rope is not None and hasattr(attention, "block"):
        if "rope_theta" not in inspect.getsource(attention.block):
            return float(inspect.signature(apply_rope).parameters["rope_theta"].default)
    return float(model.config.rope_theta)


def jpaged_config(model, max_model_len: int) -> ModelConfig:
    """jpaged's `ModelConfig` for a Tunix model (a ValueError for an unmapped family)."""
    family = type(model).__name__
    if family not in FAMILIES:
        raise ValueError(f"rollout_actor: {family} is not a mapped Tunix model family "
                         f"(mapped: {', '.join(FAMILIES)})")
    c = model.config
    if getattr(c, "num_experts", None):
        raise ValueError(f"rollout_actor: {family} with experts (num_experts={c.num_experts}) is not mapped")
    architecture, model_type = FAMILIES[family]
    tied = bool(getattr(c, "weight_tying", False) or getattr(c, "use_tied_embedding", False))
    return ModelConfig.from_hf({
        "architectures": [architecture], "model_type": model_type, "vocab_size": c.vocab_size,
        "hidden_size": c.embed_dim, "intermediate_size": c.hidden_dim, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "rope_theta": _rope_theta(model), "rms_norm_eps": c.norm_eps, "tie_word_embeddings": tied,
        "attention_bias": model_type == "qwen2", "max_position_embeddings": max_model_len,
        "hidden_act": "silu",
    })


def _int_seed(seed) -> int | None:
    """An int seed from RolloutConfig.seed (None, an int, or a JAX PRNG key)."""
    if seed is None or isinstance(seed, int):
        return seed
    if jnp.issubdtype(getattr(seed, "dtype", np.int32), jax.dtypes.prng_key):
        seed = jax.random.key_data(seed)
    return int(np.asarray(seed).ravel()[-1])


class JpagedRollout(base_rollout.BaseRollout):
    """A Tunix rollout worker that generates with a jpaged engine (paged KV cache, continuous
    batching) holding a copy of the trainer's weights, refreshed by `update_params`."""

    def __init__(self, rollout_actor, tokenizer, mesh, rollout_config: base_rollout.RolloutConfig,
                 *, memory_utilization: float = 0.5, lora_alpha: float | None = None, **engine_kwargs):
        """``rollout_actor``: the Tunix NNX model (Llama3 / Qwen2 / Qwen3), with or without qwix
        LoRA. ``tokenizer``: Tunix's ``TokenizerAdapter`` (``encode``, ``decode``, ``bos_id``,
        ``eos_id``, ``pad_id``). ``mesh``: the rollout mesh (jpaged uses the same devices;
        ``tensor_parallel_size`` in ``engine_kwargs`` shards over them). ``max_model_len``
        defaults to ``rollout_config.kv_cache_size``. ``lora_alpha``: qwix's alpha for every LoRA
        module, only needed when the model's ``qwix.LoraProvider`` cannot be found (its rules give
        it otherwise). ``engine_kwargs``: other ``LLM(...)`` settings.

        With qwix LoRA factors on the actor, the engine serves the base weights with
        ``enable_lora=True`` (``max_loras=1``, ``max_lora_rank``: the adapter's) and the factors
        as one adapter (`jpaged.integrations.qwix_lora`) that every call runs under."""
        self._actor, self._tokenizer, self._mesh = rollout_actor, tokenizer, mesh
        graphdef, state = nnx.split(rollout_actor)
        self._abstract_actor = nnx.merge(graphdef, jax.eval_shape(lambda: state))
        engine_kwargs.setdefault("max_model_len", rollout_config.kv_cache_size)
        self._config = jpaged_config(rollout_actor, engine_kwargs["max_model_len"])
        self._dtype = rollout_config.data_type or jax.tree.leaves(nnx.state(rollout_actor, nnx.Param))[0].dtype
        engine_kwargs["memory_utilization"] = memory_utilization
        factors = lora_factors(rollout_actor)
        self._lora_request, self._lora_rank_alpha = None, {}
        if factors:
            self._lora_rank_alpha = module_rank_alpha(factors, qwix_lora_rules(rollout_actor), lora_alpha)
            engine_kwargs.setdefault("enable_lora", True)
            engine_kwargs.setdefault("max_loras", 1)
            engine_kwargs.setdefault("max_lora_rank", max(int(np.shape(v)[-1]) for n, v in factors.items()
                                                          if n.endswith("_lora_a")))
            self._lora_request = LoRARequest(POLICY_ADAPTER, 1, "tunix://rollout_actor")
        model = build_model(self._config, tunix_to_hf(rollout_actor).items(), dtype=self._dtype,
                            attention_backend="xla")
        self._llm = LLM.from_model(model, tokenizer=None, **engine_kwargs)
        if factors:
            self._load_adapter(factors)

    @property
    def llm(self) -> LLM:
        """The jpaged engine underneath (for metrics, e.g. ``llm.get_metrics()``)."""
        return self._llm

    # --- BaseRollout ---------------------------------------------------------------------------

    def generate(self, prompts: list[str], rollout_config: base_rollout.RolloutConfig,
                 **kwargs) -> base_rollout.RolloutOutput:
        """Samples one completion per prompt; identical prompts share one request with ``n``."""
        if not prompts:
            raise ValueError("prompts: empty list")
        eos = [int(t) for t in (rollout_config.eos_tokens or [self.eos_id()])]
        prompt_ids = [self._tokenize(p) for p in prompts]
        groups: dict[tuple, list[int]] = {}
        for i, ids in enumerate(prompt_ids):
            groups.setdefault(tuple(ids), []).append(i)
        seed = _int_seed(rollout_config.seed)
        params = [self._sampling_params(rollout_config, len(rows), eos, None if seed is None else seed + g)
                  for g, rows in enumerate(groups.values())]
        outs = self._llm.generate([list(key) for key in groups], params, use_tqdm=False,
                                  lora_request=self._lora_request)
        tokens, logprobs = [None] * len(prompts), [None] * len(prompts)
        for rows, out in zip(groups.values(), outs):
            for row, completion in zip(rows, out.outputs):
                ids = list(completion.token_ids)
                lps = [d[t] for d, t in zip(completion.logprobs, ids)] if completion.logprobs else []
                if ids and ids[-1] in eos:
                    ids, lps = ids[:-1], lps[:-1]
                tokens[row] = np.asarray(ids, dtype=np.int32)
                logprobs[row] = [float(getattr(lp, "logprob", lp)) for lp in lps]
        longest = max(len(ids) for ids in prompt_ids)
        width = rollout_config.max_prompt_length
        width = width if width and width >= longest else next_power_of_two(longest)
        padded = np.full((len(prompts), width), self.pad_id(), dtype=np.int32)
        for row, ids in enumerate(prompt_ids):
            padded[row, width - len(ids):] = ids
        return base_rollout.RolloutOutput(
            text=[self._tokenizer.decode(t.tolist()) for t in tokens], logits=None, tokens=tokens,
            left_padded_prompt_tokens=padded,
            logprobs=logprobs if rollout_config.return_logprobs else None)

    def get_per_token_logps(self, prompt_tokens, completion_tokens):
        """``[B, C]`` float32: each completion token's logprob under the current weights
        (0 after a completion's first pad / eos). ``prompt_tokens`` left-padded ``[B, P]``,
        ``completion_tokens`` right-padded ``[B, C]``."""
        prompts, completions = np.asarray(prompt_tokens), np.asarray(completion_tokens)
        if prompts.ndim != 2 or completions.ndim != 2 or len(prompts) != len(completions):
            raise ValueError(f"prompt_tokens {prompts.shape} / completion_tokens {completions.shape}: "
                             "expected [B, P] and [B, C] with the same B")
        stop = {self.pad_id(), self.eos_id()}
        rows = []
        for p, c in zip(prompts, completions):
            first = int(np.argmax(p != self.pad_id())) if (p != self.pad_id()).any() else len(p)
            end = next((i for i, t in enumerate(c) if int(t) in stop), len(c))
            rows.append((p[first:].tolist(), c[:end].tolist()))
        scores = self._score([r for r in rows if r[1]])
        out = np.zeros(completions.shape, np.float32)
        for i, (_, completion) in enumerate(rows):
            if completion:
                out[i, :len(completion)] = scores.pop(0)
        return jnp.asarray(out)

    def update_params(self, params, filter_types=None) -> None:
        """Loads the trainer's parameters (an ``nnx.State`` of the Tunix model, full or a subset):
        base weights with `LLM.update_weights`, qwix LoRA factors (what Tunix's ``sync_weights``
        sends a LoRA policy: ``filter_types=(nnx.LoRAParam,)``) with `LLM.update_lora`, which
        rewrites the adapter's device slot in place. Nothing recompiles; the prefix cache never
        serves blocks of the old weights or factors."""
        del filter_types  # what params holds decides: its base weights and its LoRA factors
        state = params if isinstance(params, nnx.State) else nnx.state(params, nnx.Param)
        new_factors = lora_factors(state)
        has_base = any(not is_lora_factor(".".join(map(str, path)), value)
                       for path, value in nnx.to_flat_state(state))
        if new_factors and self._lora_request is None:
            raise ValueError("params: LoRA factors (nnx.LoRAParam), but the rollout actor had none when the "
                             "rollout was built, so the engine serves no adapter")
        # Tunix's sync_weights forbids explicit host transfers on CPU; the engine's placement may copy
        with jax.transfer_guard("allow"):
            if has_base:
                weights = tunix_to_hf(self._actor)  # a subset update keeps the other parameters
                weights.update(tunix_to_hf(state))
                self._llm.update_weights(weights)
            if new_factors:
                factors = lora_factors(self._actor)
                factors.update(new_factors)
                self._load_adapter(factors)

    def pad_id(self) -> int:
        return self._tokenizer.pad_id()

    def eos_id(self) -> int:
        return self._tokenizer.eos_id()

    def model(self):
        """The rollout model as Tunix sees it: the trainer's architecture with abstract
        parameters (``jax.ShapeDtypeStruct``; the weights live in the engine), so Tunix's learner
        finds that it shares none with the trainer and syncs weights after each global step.
        Tunix's ``offload_to_cpu`` (which moves this model's arrays) is not supported."""
        return self._abstract_actor

    # --- helpers -------------------------------------------------------------------------------

    def _tokenize(self, text: str) -> list[int]:
        bos = [self._tokenizer.bos_id()] if self._tokenizer.bos_id() else []
        return [int(t) for t in self._tokenizer.dedup_bos_ids(bos + list(self._tokenizer.encode(text)))]

    @staticmethod
    def _sampling_params(rc: base_rollout.RolloutConfig, n: int, eos: list[int], seed) -> SamplingParams:
        greedy = rc.top_p is None or rc.temperature == 0
        return SamplingParams(
            n=n, temperature=0.0 if greedy else float(rc.temperature),
            top_p=1.0 if greedy else float(rc.top_p), top_k=0 if greedy or not rc.top_k or rc.top_k < 0 else int(rc.top_k),
            seed=seed, max_tokens=rc.max_tokens_to_generate, stop_token_ids=eos,
            logprobs=0 if rc.return_logprobs else None)

    def _score(self, rows: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """Per-token logprobs of each completion after its prompt, in one batch (`LLM.score`)."""
        if not rows:
            return []
        return [[float(x) for x in row] for row in self._llm.score([p for p, _ in rows], [c for _, c in rows],
                                                                   lora_request=self._lora_request)]

    def _load_adapter(self, factors: dict) -> None:
        """Serves the policy's qwix LoRA ``factors`` as the rollout's adapter (registered, or its
        factors replaced in its device slot)."""
        config, tensors = qwix_lora_to_peft(factors, self._lora_rank_alpha)
        self._llm.update_lora(self._lora_request, tensors, config)
