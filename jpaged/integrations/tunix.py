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

Behaviour follows Tunix's vanilla rollout: a prompt is ``bos + encode(text)``; ``top_p=None`` (or
``temperature=0``) is greedy; a completion stops at ``eos_tokens`` (default: the tokenizer's eos),
and its tokens exclude that eos; prompts are left-padded to ``max_prompt_length`` (to the next
power of two when one is longer). Identical prompts of a batch (GRPO's ``num_generations``
copies) become one request with ``n`` samples, which share the prompt's KV blocks.

This module imports Tunix; it runs in the Tunix venv of ``scripts/setup_tunix.sh``.
"""
import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.rl.rollout import base_rollout

from jpaged import LLM, SamplingParams
from jpaged.loading.model_loader import build_model
from jpaged.models import ModelConfig
from jpaged.utils import next_power_of_two

# Tunix parameter path (layer index as {i}) -> (HF name, how the Tunix array becomes the HF one)
_LAYER_PARAMS = {
    "attn.q_proj.w": ("self_attn.q_proj.weight", "dnh"),   # [D, N, H] -> [N*H, D]
    "attn.k_proj.w": ("self_attn.k_proj.weight", "dnh"),
    "attn.v_proj.w": ("self_attn.v_proj.weight", "dnh"),
    "attn.o_proj.w": ("self_attn.o_proj.weight", "nhd"),   # [N, H, D] -> [D, N*H]
    "attn.q_bias": ("self_attn.q_proj.bias", "same"),      # Qwen2
    "attn.k_bias": ("self_attn.k_proj.bias", "same"),
    "attn.v_bias": ("self_attn.v_proj.bias", "same"),
    "attn.q_norm.w": ("self_attn.q_norm.weight", "same"),  # Qwen3
    "attn.k_norm.w": ("self_attn.k_norm.weight", "same"),
    "mlp.gate_proj.kernel": ("mlp.gate_proj.weight", "t"),  # nnx.Linear [in, out] -> [out, in]
    "mlp.up_proj.kernel": ("mlp.up_proj.weight", "t"),
    "mlp.down_proj.kernel": ("mlp.down_proj.weight", "t"),
    "input_layernorm.w": ("input_layernorm.weight", "same"),
    "post_attention_layernorm.w": ("post_attention_layernorm.weight", "same"),
}
_MODEL_PARAMS = {
    "embedder.input_embedding": ("model.embed_tokens.weight", "same"),
    "final_norm.w": ("model.norm.weight", "same"),
    "lm_head.w": ("lm_head.weight", "t"),
}
_LAYER_PATH = re.compile(r"layers\.(\d+)\.(.+)")
# Tunix class name -> the Hugging Face architecture and model_type of jpaged's model of the family
FAMILIES = {
    "Llama3": ("LlamaForCausalLM", "llama"),
    "Qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "Qwen3": ("Qwen3ForCausalLM", "qwen3"),
}


def _to_hf_layout(array, how: str):
    if how == "dnh":
        return array.reshape(array.shape[0], -1).T
    if how == "nhd":
        return array.reshape(-1, array.shape[-1]).T
    if how == "t":
        return array.T
    return jnp.copy(array)  # the engine's own buffer: the trainer may donate or overwrite its arrays


def tunix_to_hf(params) -> dict:
    """``{hf_parameter_name: array}`` of a Tunix Llama3 / Qwen2 / Qwen3 model or of an
    ``nnx.State`` of its parameters (a subset, e.g. what ``update_params`` receives, gives the
    subset). The arrays stay on their devices (reshapes, transposes and copies, no host trip)."""
    state = params if isinstance(params, nnx.State) else nnx.state(params, nnx.Param)
    hf = {}
    for path, value in nnx.to_flat_state(state):
        name = ".".join(map(str, path))
        layer = _LAYER_PATH.fullmatch(name)
        hf_name, how = (None, None)
        if layer and layer.group(2) in _LAYER_PARAMS:
            suffix, how = _LAYER_PARAMS[layer.group(2)]
            hf_name = f"model.layers.{layer.group(1)}.{suffix}"
        elif name in _MODEL_PARAMS:
            hf_name, how = _MODEL_PARAMS[name]
        if hf_name is None:
            raise ValueError(f"params: Tunix parameter {name!r} has no jpaged counterpart "
                             f"(mapped families: {', '.join(FAMILIES)})")
        hf[hf_name] = _to_hf_layout(value.get_value() if hasattr(value, "get_value") else value, how)
    return hf


def _rope_theta(model) -> float:
    """The rope base the Tunix model computes with. Tunix 0.1.7's Llama3 attention calls
    ``apply_rope`` without the config's ``rope_theta``, so it runs at that function's default;
    the rollout must compute what the trainer computes."""
    module = inspect.getmodule(type(model))
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
                 *, memory_utilization: float = 0.5, **engine_kwargs):
        """``rollout_actor``: the Tunix NNX model (Llama3 / Qwen2 / Qwen3). ``tokenizer``: Tunix's
        ``TokenizerAdapter`` (``encode``, ``decode``, ``bos_id``, ``eos_id``, ``pad_id``). ``mesh``:
        the rollout mesh (jpaged uses the same devices; ``tensor_parallel_size`` in
        ``engine_kwargs`` shards over them). ``max_model_len`` defaults to
        ``rollout_config.kv_cache_size``. ``engine_kwargs``: other ``LLM(...)`` settings."""
        self._actor, self._tokenizer, self._mesh = rollout_actor, tokenizer, mesh
        graphdef, state = nnx.split(rollout_actor)
        self._abstract_actor = nnx.merge(graphdef, jax.eval_shape(lambda: state))
        engine_kwargs.setdefault("max_model_len", rollout_config.kv_cache_size)
        self._config = jpaged_config(rollout_actor, engine_kwargs["max_model_len"])
        self._dtype = rollout_config.data_type or jax.tree.leaves(nnx.state(rollout_actor, nnx.Param))[0].dtype
        engine_kwargs["memory_utilization"] = memory_utilization
        model = build_model(self._config, tunix_to_hf(rollout_actor).items(), dtype=self._dtype,
                            attention_backend="xla")
        self._llm = LLM.from_model(model, tokenizer=None, **engine_kwargs)

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
        outs = self._llm.generate([list(key) for key in groups], params, use_tqdm=False)
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
        """Loads the trainer's parameters (an ``nnx.State`` of the Tunix model, full or a subset)
        into the engine with `LLM.update_weights` (resharded in place, nothing recompiles).
        LoRA-only updates (``filter_types`` of ``nnx.LoRAParam``) are refused."""
        types = tuple(filter_types or ())
        if any(isinstance(t, type) and issubclass(t, nnx.LoRAParam) for t in types):
            raise ValueError("filter_types: LoRA-only updates (nnx.LoRAParam) are not supported by "
                             "JpagedRollout yet; merge the adapters or train full parameters")
        weights = tunix_to_hf(self._actor)  # a subset update keeps the other parameters
        weights.update(tunix_to_hf(params))
        # Tunix's sync_weights forbids explicit host transfers on CPU; the engine's placement may copy
        with jax.transfer_guard("allow"):
            self._llm.update_weights(weights)

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
        return [[float(x) for x in row] for row in self._llm.score([p for p, _ in rows], [c for _, c in rows])]
