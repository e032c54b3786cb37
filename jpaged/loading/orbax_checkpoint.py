"""Orbax checkpoints of jpaged Flax NNX models: save a model (and its tokenizer), serve it later.

Layout of a checkpoint directory::

    <dir>/
      jpaged_checkpoint.json   marker and facts: {"format": "jpaged-orbax", "version": 1,
                               "model_class": "jpaged.models.llama:LlamaForCausalLM",
                               "param_dtype": "float32"}
      config.json              the model's config as a Hugging Face style dict (what
                               `ModelConfig.from_hf` reads back; raw fields of the original
                               config.json are kept)
      state/                   an orbax-checkpoint PyTree (``StandardCheckpointer``): the model's
                               ``nnx.State`` (parameters and buffers, RNG state excluded) as a pure
                               nested dict, e.g. ``{"layers": {0: {"self_attn": {"q_proj":
                               {"kernel": Array}}}}}``; leaves keep the dtype they had when saved
      tokenizer.json, tokenizer_config.json, ...   optional: ``tokenizer.save_pretrained(dir)``

The marker file tells a jpaged checkpoint from a Hugging Face directory (both have config.json).
``LLM(model=dir)`` serves it; the tokenizer, when present, is loaded with ``AutoTokenizer``.

On restore the model class is, in order: the ``model_cls`` argument, the class recorded in the
marker (imported by module path; it must be an ``nnx.Module`` subclass, and a class defined in
``__main__`` cannot be re-imported), or the registry entry of ``config.architecture``. The model is
built abstractly (``nnx.eval_shape``, no random init) and orbax restores straight into the
requested dtype; ``init_buffers()`` then recomputes derived buffers (rope frequencies).
"""
import importlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.config import DTYPES
from jpaged.loading.hf_checkpoint import model_config, read_json
from jpaged.models import MODEL_REGISTRY, ModelConfig

FORMAT, VERSION = "jpaged-orbax", 1
MARKER = "jpaged_checkpoint.json"
STATE_DIR = "state"


def is_orbax_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


def config_to_hf(config: ModelConfig) -> dict:
    """A config.json dict that `ModelConfig.from_hf` reads back as ``config`` (raw extras kept)."""
    d = dict(config.hf)
    text = d
    if isinstance(d.get("text_config"), dict):
        text = d["text_config"] = dict(d["text_config"])
    d["architectures"], d["model_type"] = [config.architecture], config.model_type
    eos = list(config.eos_token_ids)
    text.update(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim, max_position_embeddings=config.max_position_embeddings,
        intermediate_size=config.intermediate_size, rms_norm_eps=config.norm_eps,
        rope_theta=config.rope_theta, rope_scaling=config.rope_scaling,
        tie_word_embeddings=config.tie_word_embeddings, attention_bias=config.attention_bias,
        hidden_act=config.hidden_act, bos_token_id=config.bos_token_id,
        eos_token_id=eos[0] if len(eos) == 1 else (eos or None))
    text.pop("rope_parameters", None)  # rope_theta / rope_scaling (/ rope_local_base_freq) say it all
    if config.local_rope_theta is not None:
        text["rope_local_base_freq"] = config.local_rope_theta
    return d


def as_hf_tokenizer(tokenizer):
    """A Hugging Face tokenizer: a `tokenizers.Tokenizer` is wrapped in ``PreTrainedTokenizerFast``."""
    if tokenizer is None or hasattr(tokenizer, "save_pretrained"):
        return tokenizer
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    if isinstance(tokenizer, Tokenizer):
        return PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    raise ValueError(f"tokenizer: expected a transformers or tokenizers tokenizer, got {type(tokenizer).__name__}")


def _savable_state(model):
    return nnx.state(model, nnx.Not(nnx.RngState))


def _param_dtype(model) -> str | None:
    for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            return jnp.dtype(leaf.dtype).name
    return None


def save_checkpoint(model, path: str, tokenizer=None, *, overwrite: bool = False) -> str:
    """Saves ``model`` (a jpaged NNX model with a ``.config``) and ``tokenizer`` to ``path``.

    Returns the absolute path. The arrays are written from where they live (device or host) by
    orbax; nothing is converted to another format first.
    """
    import orbax.checkpoint as ocp

    if not isinstance(getattr(model, "config", None), ModelConfig):
        raise ValueError(f"model: {type(model).__name__} has no ModelConfig `.config`; "
                         "a jpaged model needs one to be served again")
    from jpaged.models.quantized import QUANTIZED_MODULES

    quantized = [type(m).__name__ for _, m in nnx.iter_modules(model) if isinstance(m, QUANTIZED_MODULES)]
    if quantized:
        raise ValueError(f"model: holds quantized layers ({quantized[0]}, ...); save the float model and "
                         "pass quantization= when loading it")
    path = os.path.abspath(path)
    if os.path.exists(os.path.join(path, STATE_DIR)) and not overwrite:
        raise ValueError(f"path={path!r}: already holds a checkpoint (pass overwrite=True)")
    os.makedirs(path, exist_ok=True)
    tokenizer = as_hf_tokenizer(tokenizer)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(path, STATE_DIR), nnx.to_pure_dict(_savable_state(model)), force=overwrite)
    cls = type(model)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_to_hf(model.config), f, indent=2)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    with open(os.path.join(path, MARKER), "w") as f:  # written last: its presence means complete
        json.dump({"format": FORMAT, "version": VERSION, "model_class": f"{cls.__module__}:{cls.__qualname__}",
                   "param_dtype": _param_dtype(model)}, f, indent=2)
    return path


def read_manifest(path: str) -> tuple[dict, ModelConfig]:
    """(marker dict, ModelConfig) of a checkpoint directory, validated."""
    marker = read_json(os.path.join(path, MARKER))
    if marker.get("format") != FORMAT or marker.get("version", 0) > VERSION:
        raise ValueError(f"model={path!r}: {MARKER} has format {marker.get('format')!r} version "
                         f"{marker.get('version')!r}; this jpaged reads {FORMAT!r} up to version {VERSION}")
    config_file = os.path.join(path, "config.json")
    return marker, model_config(read_json(config_file), config_file)


def _model_class(marker: dict, config: ModelConfig, path: str):
    recorded = marker.get("model_class") or ""
    module, _, qualname = recorded.partition(":")
    if module and module != "__main__":
        try:
            obj = importlib.import_module(module)
            for part in qualname.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError):
            obj = None
        if isinstance(obj, type) and issubclass(obj, nnx.Module):
            return obj
    if config.architecture in MODEL_REGISTRY:
        return MODEL_REGISTRY[config.architecture]
    raise ValueError(f"model={path!r}: model class {recorded!r} cannot be imported and architecture "
                     f"{config.architecture!r} is not in jpaged.models.MODEL_REGISTRY; make the class "
                     "importable, register it, or pass model_cls= to load_checkpoint")


def load_checkpoint(path: str, *, dtype=None, attention_backend: str = "xla", model_cls=None):
    """(model, ModelConfig, tokenizer or None) restored from a directory `save_checkpoint` wrote.

    ``dtype``: a jnp dtype or its name; None keeps the saved parameter dtype.
    """
    import orbax.checkpoint as ocp

    from jpaged.loading.hf_checkpoint import load_tokenizer

    path = os.path.abspath(path)
    marker, config = read_manifest(path)
    if dtype is None:
        dtype = marker.get("param_dtype") or "float32"
    dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    cls = model_cls or _model_class(marker, config, path)
    model = nnx.eval_shape(lambda: cls(config, dtype=dtype, attention_backend=attention_backend,
                                       rngs=nnx.Rngs(0)))
    state = _savable_state(model)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                          nnx.to_pure_dict(state))
    with ocp.StandardCheckpointer() as ckptr:
        try:
            restored = ckptr.restore(os.path.join(path, STATE_DIR), target)
        except (ValueError, KeyError) as e:
            raise ValueError(f"model={path!r}: the saved state does not fit {cls.__name__}: {e}") from e
    nnx.replace_by_pure_dict(state, restored)
    nnx.update(model, state)
    if hasattr(model, "init_buffers"):
        model.init_buffers()
    return model, config, load_tokenizer(path)


def read_as_hf(path: str):
    """(hf config dict, iterable of (HF tensor name, numpy array), tokenizer) of a checkpoint, for
    loaders that place weights themselves (e.g. sharded). Needs a model class with ``hf_weight_map``."""
    model, config, tokenizer = load_checkpoint(path)
    if not hasattr(model, "hf_weight_map"):
        raise ValueError(f"model={path!r}: {type(model).__name__} has no hf_weight_map")

    def weights():
        for attr_path, name, transpose in model.hf_weight_map():
            node = model
            for p in attr_path:
                node = node[p] if isinstance(p, int) else getattr(node, p)
            array = np.asarray(node[...])
            yield name, array.T if transpose else array

    return config_to_hf(config), weights(), tokenizer
