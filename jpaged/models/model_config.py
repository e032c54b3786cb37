"""The model facts the engine needs, read from a Hugging Face `config.json` dictionary."""
from dataclasses import dataclass, field


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
    hf: dict = field(default_factory=dict, repr=False)  # the raw config, for model-specific fields

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
        rope = text.get("rope_scaling") or text.get("rope_parameters")
        rope_theta = text.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
        if rope is not None and rope.get("rope_type", rope.get("type")) in (None, "default"):
            rope = None
        return cls(
            architecture=arch, model_type=model_type,
            vocab_size=text["vocab_size"], hidden_size=hidden, num_layers=layers, num_heads=heads,
            num_kv_heads=kv_heads, head_dim=text.get("head_dim") or hidden // heads,
            max_position_embeddings=(text.get("max_position_embeddings") or text.get("n_positions")
                                     or 2048),
            intermediate_size=text.get("intermediate_size") or text.get("ffn_dim") or text.get("n_inner")
            or 4 * hidden,
            norm_eps=text.get("rms_norm_eps") or text.get("layer_norm_epsilon") or 1e-5,
            rope_theta=float(rope_theta), rope_scaling=rope,
            tie_word_embeddings=bool(text.get("tie_word_embeddings", model_type in ("gpt2", "opt"))),
            attention_bias=bool(text.get("attention_bias", model_type == "qwen2")),
            hidden_act=text.get("hidden_act") or text.get("activation_function") or "silu",
            bos_token_id=text.get("bos_token_id"), eos_token_ids=eos_ids, hf=d)
