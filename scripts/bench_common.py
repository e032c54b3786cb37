"""Pieces the benchmark scripts share: the bench-llama checkpoint, the shared workloads, compile time."""
import os
import sys

import jax

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS_DIR = os.path.join(REPO_ROOT, "..", "shared", "peers")
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "jpaged")


def bench_model_dir(cache_dir: str) -> str:
    """The shared random ``bench-llama`` checkpoint, built once (the config of make_bench_model.py)."""
    path = os.path.join(cache_dir, "bench-llama")
    if not os.path.exists(os.path.join(path, "config.json")):
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        cfg = LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=6, num_attention_heads=8,
                          num_key_value_heads=2, vocab_size=32000, max_position_embeddings=4096,
                          bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1)
        LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def load_workload(peers_dir: str, name: str, vocab_size: int, num_requests=None, seed: int = 0,
                  length_scale: float = 1.0):
    """(prompts, output_lens) from the shared ``workloads.py``, lengths scaled by ``length_scale``."""
    if not os.path.isfile(os.path.join(peers_dir, "workloads.py")):
        raise FileNotFoundError(f"--peers_dir={peers_dir!r}: no workloads.py (the shared/peers folder beside the repo)")
    sys.path.insert(0, os.path.abspath(peers_dir))
    try:
        from workloads import make_workload
    finally:
        sys.path.pop(0)
    prompts, output_lens = make_workload(name, vocab_size, num_requests, seed)
    if length_scale != 1.0:
        prompts = [p[:max(1, round(len(p) * length_scale))] for p in prompts]
        output_lens = [max(1, round(n * length_scale)) for n in output_lens]
    return prompts, output_lens



COMPILE_SECONDS = [0.0]  # tracing, lowering and compiling (or loading from the persistent cache)


def _count_compile_time(event: str, duration: float, **_) -> None:
    if event.startswith("/jax/core/compile/"):
        COMPILE_SECONDS[0] += duration


jax.monitoring.register_event_duration_secs_listener(_count_compile_time)
