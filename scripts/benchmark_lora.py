"""Output throughput with many LoRA adapters served at once, against the base model alone.

  python scripts/benchmark_lora.py                                   # bench-llama, fixed 32, ranks 8 and 64
  python scripts/benchmark_lora.py --ranks 16 --num_adapters 0,4     # the 4-adapters-of-rank-16 target
  python scripts/benchmark_lora.py --length_scale 0.25               # shorter prompts and outputs

Runs the real engine on the ``fixed`` workload of ``scripts/workloads.py`` (32 prompts of 128
tokens, 128 output tokens each, greedy with ``ignore_eos``), all queued at once. With N adapters
the requests take adapters round-robin (N = 0: the base model, ``enable_lora`` off); every adapter
targets q/k/v/o and gate/up/down with random factors, written as a PEFT directory (adapter_config.json
+ adapter_model.safetensors) into ``--cache_dir``, and the engine has ``max_loras = N`` device slots
of the run's rank. Time spent compiling (JAX's compile events) is subtracted from the timed run.

Prints per (rank, N): output tokens/s and its ratio to the base model's, and output tokens per
second of this process's CPU time (all its threads; on a shared machine it reflects the work done
better than the wall clock) and its ratio; per rank: an adapter's host
load time (read + checks), its device-slot write time and its bytes per slot.
"""
import json
import os
import time

import numpy as np
from absl import app, flags

from bench_common import CACHE_DIR, COMPILE_SECONDS, describe_machine, model_dir
from workloads import make_workload
from jpaged import LLM, LoRARequest, SamplingParams

F = flags.FLAGS
flags.DEFINE_string("model", "bench-llama", "HF checkpoint directory, or bench-llama / smollm2 (built into --cache_dir)")
flags.DEFINE_string("cache_dir", CACHE_DIR, "Where bench-llama and the random adapters are built")
flags.DEFINE_list("ranks", ["8", "64"], "LoRA ranks to run (each with its own max_lora_rank)")
flags.DEFINE_list("num_adapters", ["0", "1", "4", "16"], "Distinct adapters per run (0: the base model)")
flags.DEFINE_integer("num_requests", 32, "Requests of the fixed workload")
flags.DEFINE_float("length_scale", 1.0, "Multiplies every prompt and output length")
flags.DEFINE_integer("num_kv_blocks", 1024, "KV pool size in blocks")
flags.DEFINE_integer("max_num_batched_tokens", 2048, "Tokens per step")

TARGETS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_adapter(path: str, config: dict, rank: int, seed: int) -> str:
    """A random PEFT LoRA adapter of the model ``config`` (its config.json), all 7 projections."""
    from safetensors.numpy import save_file

    if os.path.exists(os.path.join(path, "adapter_config.json")):
        return path
    h, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for part, names in TARGETS.items():
            for name in names:
                din, dout = dims[name]
                key = f"base_model.model.model.layers.{layer}.{part}.{name}"
                tensors[f"{key}.lora_A.weight"] = rng.standard_normal((rank, din), np.float32) * 0.02
                tensors[f"{key}.lora_B.weight"] = rng.standard_normal((dout, rank), np.float32) * 0.02
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
                   "target_modules": [n for names in TARGETS.values() for n in names]}, f)
    return path


def run(model: str, prompts, params, rank: int, loras: list) -> dict:
    kwargs = dict(num_kv_blocks=F.num_kv_blocks, max_num_seqs=len(prompts), max_num_batched_tokens=F.max_num_batched_tokens)
    if loras:
        kwargs.update(enable_lora=True, max_loras=len(loras), max_lora_rank=rank)
    llm = LLM(model, **kwargs)
    figures = {}
    if loras:  # host read + checks of one adapter, then its device-slot write
        manager = llm.llm_engine.lora
        start = time.perf_counter()
        adapter = manager.adapter(loras[0])
        figures["host_load_s"] = time.perf_counter() - start
        start = time.perf_counter()
        llm.llm_engine.runner.write_lora_slots([(1, loras[0])])
        figures["slot_write_s"] = time.perf_counter() - start
        figures["bytes_per_slot"] = adapter.nbytes
    per_prompt = [loras[i % len(loras)] for i in range(len(prompts))] if loras else None
    warm = [SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)] * len(prompts)  # the batch's shapes
    llm.generate([p[::-1] for p in prompts], warm, use_tqdm=False, lora_request=per_prompt)  # no prefix-cache hits later
    compile_start, start, cpu_start = COMPILE_SECONDS[0], time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=per_prompt)
    compiling = COMPILE_SECONDS[0] - compile_start
    seconds = time.perf_counter() - start - compiling
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    figures["output_tok_s"] = tokens / seconds
    figures["output_tok_cpu_s"] = tokens / (time.process_time() - cpu_start)  # compiles here count (rare after the warm run)
    return figures


def main(argv):
    del argv
    print(describe_machine())
    model = model_dir(F.model, F.cache_dir)
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    prompts, lengths = make_workload("fixed", config["vocab_size"], F.num_requests, length_scale=F.length_scale)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    base = base_cpu = None
    for rank in map(int, F.ranks):
        for n in map(int, F.num_adapters):
            loras = [LoRARequest(f"r{rank}-{i}", i + 1,
                                 write_adapter(os.path.join(F.cache_dir, "lora", f"{F.model}-r{rank}-{i}"), config,
                                               rank, seed=i)) for i in range(n)]
            if n == 0 and base is not None:
                continue
            figures = run(model, prompts, params, rank, loras)
            if n == 0:
                base, base_cpu = figures["output_tok_s"], figures["output_tok_cpu_s"]
            ratio = (f", {figures['output_tok_s'] / base:.3f} x base; per CPU second {figures['output_tok_cpu_s']:.1f} "
                     f"tok, {figures['output_tok_cpu_s'] / base_cpu:.3f} x base") if base else ""
            extra = "" if not n else (f"; one adapter: host load {figures['host_load_s'] * 1e3:.1f} ms, slot write "
                                      f"{figures['slot_write_s'] * 1e3:.1f} ms, {figures['bytes_per_slot'] / 2**20:.2f} MiB per slot")
            print(f"rank={rank} adapters={n}: {figures['output_tok_s']:.1f} output tok/s{ratio}{extra}", flush=True)


if __name__ == "__main__":
    app.run(main)
