"""Tunix models' parameters under Hugging Face names (Tunix's ``Llama3``, ``Qwen2``, ``Qwen3``):
the names and layouts jpaged's loader reads. No Tunix import: this runs in any environment.

qwix LoRA factors (``nnx.LoRAParam``, ``<weight>_lora_a`` / ``_lora_b``) are not weights of the
base model: `tunix_to_hf` leaves them out (`jpaged.integrations.qwix_lora` maps them).
"""
import re

import jax.numpy as jnp
from flax import nnx

# Tunix parameter path (layer index as {i}) -> (HF name, how the Tunix array becomes the HF one)
LAYER_PARAMS = {
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
MODEL_PARAMS = {
    "embedder.input_embedding": ("model.embed_tokens.weight", "same"),
    "final_norm.w": ("model.norm.weight", "same"),
    "lm_head.w": ("lm_head.weight", "t"),
}
LAYER_PATH = re.compile(r"layers\.(\d+)\.(.+)")


def is_lora_factor(name: str, value=None) -> bool:
    """Whether a Tunix parameter (dotted path, and its variable if known) is a qwix LoRA factor."""
    return isinstance(value, nnx.LoRAParam) or name.endswith(("_lora_a", "_lora_b"))


def to_hf_layout(array, how: str):
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
        if is_lora_factor(name, value):
            continue
        layer = LAYER_PATH.fullmatch(name)
        hf_name, how = (None, None)
        if layer and layer.group(2) in LAYER_PARAMS:
            suffix, how = LAYER_PARAMS[layer.group(2)]
            hf_name = f"model.layers.{layer.group(1)}.{suffix}"
        elif name in MODEL_PARAMS:
            hf_name, how = MODEL_PARAMS[name]
        if hf_name is None:
            raise ValueError(f"params: Tunix parameter {name!r} has no jpaged counterpart "
                             "(mapped: Llama3, Qwen2, Qwen3)")
        hf[hf_name] = to_hf_layout(value.get_value() if hasattr(value, "get_value") else value, how)
    return hf
