"""Pieces the benchmark scripts share: the bench-llama checkpoint, the workloads, compile time.

  python scripts/bench_common.py DIR     # writes bench-llama into DIR (for a peer engine to load)
"""
import os
import sys

import jax
import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "jpaged")


BENCH_LLAMA = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=6, num_attention_heads=8,
                   num_key_value_heads=2, vocab_size=32000, max_position_embeddings=4096,
                   bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)


def make_bench_model(path: str, seed: int = 0, std: float = 0.1, **overrides) -> str:
    """Writes the random ``bench-llama`` checkpoint (~50M parameters, float32) as a Hugging Face
    directory: ``LlamaConfig.save_pretrained`` plus ``model.safetensors`` under the names and
    layout ``LlamaForCausalLM.save_pretrained`` uses, so transformers, vLLM and jpaged all load the
    same weights. Weights are normal(0, ``std``), norms 1, the pad row of the embedding 0; torch is
    not needed. ``overrides`` change the config (tests build a smaller one)."""
    from safetensors.numpy import save_file
    from transformers import LlamaConfig

    cfg = LlamaConfig(**{**BENCH_LLAMA, **overrides}, initializer_range=std, architectures=["LlamaForCausalLM"])
    h, inter, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    head_dim = h // cfg.num_attention_heads
    kv = cfg.num_key_value_heads * head_dim
    rng = np.random.default_rng(seed)
    normal = lambda *shape: (rng.standard_normal(shape, np.float32) * std)  # noqa: E731
    ones = lambda n: np.ones(n, np.float32)  # noqa: E731
    weights = {"model.embed_tokens.weight": normal(v, h)}
    weights["model.embed_tokens.weight"][cfg.pad_token_id] = 0.0
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        weights.update({
            p + "self_attn.q_proj.weight": normal(h, h), p + "self_attn.k_proj.weight": normal(kv, h),
            p + "self_attn.v_proj.weight": normal(kv, h), p + "self_attn.o_proj.weight": normal(h, h),
            p + "mlp.gate_proj.weight": normal(inter, h), p + "mlp.up_proj.weight": normal(inter, h),
            p + "mlp.down_proj.weight": normal(h, inter),
            p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h)})
    weights["model.norm.weight"] = ones(h)
    weights["lm_head.weight"] = normal(v, h)
    os.makedirs(path, exist_ok=True)
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(path)  # config.json last: its presence marks a complete checkpoint
    return path


def bench_model_dir(cache_dir: str) -> str:
    """``cache_dir``/bench-llama, built on first use."""
    path = os.path.join(cache_dir, "bench-llama")
    if not os.path.exists(os.path.join(path, "config.json")):
        make_bench_model(path)
    return path


COMPILE_SECONDS = [0.0]  # tracing, lowering and compiling (or loading from the persistent cache)


def _count_compile_time(event: str, duration: float, **_) -> None:
    if event.startswith("/jax/core/compile/"):
        COMPILE_SECONDS[0] += duration


jax.monitoring.register_event_duration_secs_listener(_count_compile_time)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/bench_common.py DIR")
    print(make_bench_model(sys.argv[1]))
