"""The model facts the engine needs, read from a Hugging Face `config.json` dictionary.

Attention per layer: ``sliding_windows[i]`` is layer i's window (a query at position p sees keys
``p - window < j <= p``) or None (global), from ``layer_types`` where the config has it, else by
each architecture's own rule (Mistral and Mixtral: every layer; Qwen2/3: ``use_sliding_window``
from ``max_window_layers`` on; Gemma 2: every other layer; Gemma 3: all but every
``sliding_window_pattern``-th). A field the engine cannot honour is a ValueError naming it.
Qwen3-Next and Qwen3.5 (`RECURRENT_MODEL_TYPES`) also have ``linear_attention`` layers, which keep
a recurrent state instead of KV (`jpaged.models.gated_delta_net`); their window here is None.

Multi-head latent attention (DeepSeek-V2/V3, `MLA_MODEL_TYPES`) caches one latent row of
``kv_lora_rank + qk_rope_head_dim`` values per token for all heads: its ``num_kv_heads`` (1) and
``head_dim`` (half the row) are the KV pool's geometry, the row's two halves living in the pool's
K and V page tensors (`jpaged.models.deepseek`).
"""
from dataclasses import dataclass, field

LAYER_TYPES = ("full_attention", "sliding_attention")  # the layer_types values jpaged runs
# layer_types of layers that keep a recurrent state instead of KV, and the model types that have them
RECURRENT_LAYER_TYPES = ("linear_attention",)
RECURRENT_MODEL_TYPES = ("qwen3_next", "qwen3_5_text")
MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")  # multi-head latent attention: a latent KV pool


@dataclass
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    intermediate_size: int = 0
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_windows: tuple[int | None, ...] = ()  # per layer: its window, or None (global); () = all global
    attn_logit_softcap: float | None = None     # Gemma 2: cap * tanh(score / cap) on attention scores
    final_logit_softcap: float | None = None    # Gemma 2: the same on the output logits
    query_pre_attn_scalar: float | None = None  # Gemma: attention scale = query_pre_attn_scalar ** -0.5
    local_rope_theta: float | None = None       # Gemma 3: the rope base of the sliding-window layers
    hf: dict = field(default_factory=dict, repr=False)  # the raw config, for model-specific fields

    def window_of(self, layer: int) -> int | None:
        return self.sliding_windows[layer] if self.sliding_windows else None

    @classmethod
    def from_hf(cls, d: dict) -> "ModelConfig":
        arch = (d.get("architectures") or [d.get("model_type", "?")])[0]
        model_type = d.get("model_type", "")
        text = d.get("text_config") or d
        hidden = text.get("hidden_size") or text.get("n_embd") or text.get("d_model")
        heads = text.get("num_attention_heads") or text.get("n_head")
        layers = text.get("num_hidden_layers") or text.get("n_layer")
        kv_heads = text.get("num_key_value_heads") or heads
        eos = text.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        rope, rope_theta, local_theta = _rope(text, model_type)
        head_dim = text.get("head_dim") or hidden // heads
        if model_type in MLA_MODEL_TYPES:
            kv_heads, head_dim = 1, latent_row_width(text) // 2
        return cls(
            architecture=arch, model_type=model_type,
            vocab_size=text["vocab_size"], hidden_size=hidden, num_layers=layers, num_heads=heads,
            num_kv_heads=kv_heads, head_dim=head_dim,
            max_position_embeddings=(text.get("max_position_embeddings") or text.get("n_positions")
                                     or 2048),
            intermediate_size=text.get("intermediate_size") or text.get("ffn_dim") or text.get("n_inner")
            or 4 * hidden,
            norm_eps=text.get("rms_norm_eps") or text.get("layer_norm_epsilon") or 1e-5,
            rope_theta=float(rope_theta), rope_scaling=rope,
            tie_word_embeddings=bool(text.get("tie_word_embeddings", model_type in ("gpt2", "opt"))),
            attention_bias=bool(text.get("attention_bias", model_type == "qwen2")),
            hidden_act=(text.get("hidden_act") or text.get("hidden_activation") or text.get("activation_function")
                        or "silu"),
            bos_token_id=text.get("bos_token_id"), eos_token_ids=eos_ids,
            sliding_windows=_layer_windows(text, model_type, layers),
            # transformers' Gemma 3 attention takes no soft cap, whatever its config says
            attn_logit_softcap=None if model_type == "gemma3_text" else text.get("attn_logit_softcapping"),
            final_logit_softcap=text.get("final_logit_softcapping"),
            query_pre_attn_scalar=text.get("query_pre_attn_scalar"), local_rope_theta=local_theta, hf=d)


def latent_row_width(text: dict) -> int:
    """``kv_lora_rank + qk_rope_head_dim`` of an MLA config: the values cached per token (even, as
    the pool stores the row in two halves)."""
    for name in ("kv_lora_rank", "qk_rope_head_dim"):
        value = text.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: must be a positive integer")
    width = text["kv_lora_rank"] + text["qk_rope_head_dim"]
    if width % 2:
        raise ValueError(f"kv_lora_rank={text['kv_lora_rank']}: kv_lora_rank + qk_rope_head_dim={width} must be "
                         "even (the latent row is stored as two halves)")
    return width


def _is_default(rope: dict | None) -> bool:
    return rope is None or rope.get("rope_type", rope.get("type")) in (None, "default")


def _rope(text: dict, model_type: str) -> tuple[dict | None, float, float | None]:
    """(rope scaling of the global layers or None, their rope base, the sliding layers' base or
    None) from the classic fields (``rope_theta``, ``rope_scaling``, ``rope_local_base_freq``) or
    transformers 5's ``rope_parameters`` (one dict, or one per layer type)."""
    params = text.get("rope_parameters")
    gemma3 = model_type == "gemma3_text"
    if isinstance(params, dict) and set(params) & set(LAYER_TYPES):
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        if not _is_default(local):
            raise ValueError(f"rope_parameters.sliding_attention={local!r}: only the default rope is supported "
                             "on sliding-window layers")
        rope, theta, local_theta = full, full.get("rope_theta"), local.get("rope_theta")
    else:
        rope = text.get("rope_scaling") or params
        theta = text.get("rope_theta") or (rope or {}).get("rope_theta")
        local_theta = text.get("rope_local_base_freq")
    if gemma3:  # transformers' defaults for Gemma 3 (global 1e6, local 1e4)
        theta, local_theta = theta or 1_000_000.0, local_theta or 10_000.0
    return (None if _is_default(rope) else rope), float(theta or 10000.0), \
        (None if local_theta is None else float(local_theta))


def _layer_windows(text: dict, model_type: str, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window or None (the module docstring's rules)."""
    window = text.get("sliding_window")
    types = text.get("layer_types")
    if types is not None:
        if model_type == "llama4_text":  # its chunked layers keep all their blocks (jpaged.models.llama4)
            types = ["full_attention" if t == "chunked_attention" else t for t in types]
        runs = LAYER_TYPES + (RECURRENT_LAYER_TYPES if model_type in RECURRENT_MODEL_TYPES else ())
        bad = sorted(set(types) - set(runs))
        if bad:
            raise ValueError(f"layer_types: {bad} not supported (jpaged runs {list(runs)} for model_type="
                             f"{model_type!r})")
        if len(types) != num_layers:
            raise ValueError(f"layer_types: {len(types)} entries for num_hidden_layers={num_layers}")
    elif model_type in ("mistral", "mixtral"):
        types = ["sliding_attention"] * num_layers
    elif model_type in ("qwen2", "qwen3", "qwen3_moe"):
        first = 0 if model_type == "qwen3_moe" else text.get("max_window_layers", num_layers)
        sliding = bool(text.get("use_sliding_window"))
        types = ["sliding_attention" if sliding and i >= first else "full_attention" for i in range(num_layers)]
    elif model_type == "gemma2":
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    elif model_type == "gemma3_text":
        pattern = text.get("sliding_window_pattern", 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    else:
        return (None,) * num_layers
    if "sliding_attention" not in types or window is None:
        if "sliding_attention" in types and text.get("layer_types") is not None:
            raise ValueError("sliding_window=None: layer_types has sliding_attention layers but no window")
        return (None,) * num_layers
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window={window!r}: must be a positive integer")
    return tuple(window if t == "sliding_attention" else None for t in types)


# ModelConfig attribute -> the config.json field it comes from (for error messages)
HF_FIELDS = {"sliding_windows": "sliding_window", "attn_logit_softcap": "attn_logit_softcapping",
             "final_logit_softcap": "final_logit_softcapping", "query_pre_attn_scalar": "query_pre_attn_scalar",
             "local_rope_theta": "rope_local_base_freq"}


def require_unset(config: ModelConfig, model: str, *attributes: str) -> None:
    """ValueError naming the config.json field of the first of ``attributes`` that the checkpoint
    sets: ``model`` cannot honour it (a sliding window counts when any layer has one)."""
    for name in attributes:
        value = getattr(config, name)
        if name == "sliding_windows":
            value = next((w for w in value if w is not None), None)
        if value is not None:
            raise ValueError(f"{HF_FIELDS.get(name, name)}={value!r}: not supported by {model} "
                             f"({config.architecture})")
