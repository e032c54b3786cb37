"""Perplexity, greedy agreement, memory and decode speed of each weight and KV-cache quantization setting.

  python scripts/perplexity.py                                    # SmolLM2-135M (embedded GGUF): none, int8, gguf
  python scripts/perplexity.py --settings none,kv=int8,kv=fp8,int8+kv=int8
  python scripts/perplexity.py --settings none,int8 --num_windows 4
  python scripts/perplexity.py --model path/to/hf_dir --settings none,int8 --dtype bfloat16

The text is real English prose every Python installation ships: the Language Reference topics of
``pydoc_data.topics`` (what ``help("assert")`` prints), topics in sorted order, paragraphs of prose
only (indented code and grammar blocks and heading underlines dropped). Its first ``num_windows x
window`` tokens are cut into windows of ``window`` tokens; each window is one prompt, teacher-forced
through the engine's real paged path with ``SamplingParams(prompt_logprobs=1)``: every token after
the first of a window is scored given the tokens before it in the window.

Per setting, in a fresh subprocess (so that its peak RSS is its own):

* ``ppl``: exp of the mean negative log-likelihood of the scored tokens;
* ``argmax_agreement``: share of scored positions whose most likely next token equals the one of
  setting ``none`` (same text, teacher-forced);
* ``greedy_agreement``: share of a greedy continuation (``decode_tokens`` tokens after the first 32
  tokens of the text) identical to ``none``'s, up to the first difference;
* ``weight_mib``: bytes of the model's parameter arrays; ``peak_rss_mib``: the process's peak
  resident memory (``resource.getrusage``) once ``LLM(...)`` has loaded and compiled, ``rss_mib``
  its resident memory at that moment (VmRSS);
* ``decode_tok_s``: single-stream decode speed, ``decode_tokens / (t(1 + decode_tokens) - t(1))``
  (generation time with and without the decode steps, best of 3 each), after warm-up runs.
"""
import json
import math
import os
import subprocess
import sys
import time

from absl import app, flags

F = flags.FLAGS
flags.DEFINE_string("model", None, "HF directory, .gguf file or preset; default: embedded SmolLM2-135M-Instruct")
flags.DEFINE_list("settings", ["none", "int8", "gguf"],
                  "Settings to measure: a weight quantization (none | int8 | gguf), optionally '+kv=' a KV cache "
                  "dtype (auto | int8 | fp8), or 'kv=...' alone (none = unquantized)")
flags.DEFINE_string("dtype", "float32", "Engine dtype (activations, KV cache, unquantized weights)")
flags.DEFINE_integer("num_windows", 8, "Windows of text")
flags.DEFINE_integer("window", 512, "Tokens per window")
flags.DEFINE_integer("decode_tokens", 64, "Tokens of the greedy continuation and the decode timing")
flags.DEFINE_string("output", None, "Also write the results as JSON here")
flags.DEFINE_string("worker", None, "Internal: measure this one setting and print JSON")


def english_text() -> str:
    """The prose paragraphs of the Language Reference topics, in sorted topic order."""
    from pydoc_data.topics import topics

    paragraphs = []
    for name in sorted(topics):
        for para in topics[name].split("\n\n"):
            lines = [ln for ln in para.strip("\n").split("\n") if ln.strip()]
            if not lines or any(ln.startswith(" ") for ln in lines):
                continue  # code, grammar, tables, indented notes
            if set(lines[-1].strip()) <= set("*=-~^"):
                continue  # a heading and its underline
            paragraphs.append(" ".join(ln.strip() for ln in lines))
    return "\n\n".join(paragraphs)


WEIGHTS, KV_DTYPES = ("none", "int8", "gguf"), ("auto", "int8", "fp8")


def parse_setting(setting: str) -> tuple[str | None, str]:
    """``"int8+kv=fp8"`` -> (``quantization``, ``kv_cache_dtype``) = ("int8", "fp8")."""
    quantization, kv = None, "auto"
    for part in setting.split("+"):
        if part.startswith("kv=") and part[3:] in KV_DTYPES:
            kv = part[3:]
        elif part in WEIGHTS:
            quantization = None if part == "none" else part
        else:
            raise app.UsageError(f"--settings: {setting!r}: {part!r} is not one of {WEIGHTS} or kv={KV_DTYPES}")
    return quantization, kv


def measure(setting: str) -> dict:
    import resource

    import jax

    from jpaged import LLM, SamplingParams

    start = time.perf_counter()
    quantization, kv_cache_dtype = parse_setting(setting)
    llm = LLM(F.model, quantization=quantization, kv_cache_dtype=kv_cache_dtype, dtype=F.dtype,
              max_num_batched_tokens=F.window, max_num_seqs=4, max_model_len=max(F.window, 256) + F.decode_tokens,
              enable_prefix_caching=False)  # repeated timing runs see the same step shapes
    load_s = time.perf_counter() - start
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    rss = _current_rss_mib()
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(llm.llm_engine.runner.state))

    ids = llm.get_tokenizer()(english_text(), add_special_tokens=False)["input_ids"]
    if len(ids) < F.num_windows * F.window:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than num_windows x window")
    windows = [ids[i * F.window:(i + 1) * F.window] for i in range(F.num_windows)]
    start = time.perf_counter()
    outs = llm.generate(windows, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    score_s = time.perf_counter() - start
    nll, argmax = 0.0, []
    for window, out in zip(windows, outs):
        for token, logprobs in zip(window[1:], out.prompt_logprobs[1:]):
            nll -= logprobs[token]
            argmax.append(max(logprobs, key=logprobs.get))

    prompt = ids[:32]
    def timed(n):
        t = time.perf_counter()
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t, out[0].outputs[0].token_ids

    timed(1 + F.decode_tokens)  # warm-up: compiles every step shape both runs use
    timed(1)
    t1 = min(timed(1)[0] for _ in range(3))  # best of 3: the machine may be shared
    runs = [timed(1 + F.decode_tokens) for _ in range(3)]
    tn, continuation = min(t for t, _ in runs), runs[0][1]
    return dict(setting=setting, ppl=math.exp(nll / len(argmax)), scored_tokens=len(argmax),
                weight_mib=weight_bytes / 2**20, peak_rss_mib=peak_rss, rss_mib=rss, load_s=load_s, score_s=score_s,
                decode_tok_s=F.decode_tokens / (tn - t1), argmax=argmax, continuation=continuation)


def _current_rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:")) / 1024


def agreement(a: list, b: list, prefix: bool = False) -> float:
    same = [x == y for x, y in zip(a, b)]
    if prefix:
        return (same.index(False) if False in same else len(same)) / len(same)
    return sum(same) / len(same)


def main(argv):
    del argv
    if F.worker is not None:
        print("RESULT " + json.dumps(measure(F.worker)), flush=True)
        return
    for setting in F.settings:
        parse_setting(setting)
    results = []
    for setting in F.settings:
        args = [sys.executable, os.path.abspath(__file__), f"--worker={setting}"] + [
            f"--{name}={getattr(F, name)}" for name in ("dtype", "num_windows", "window", "decode_tokens")]
        if F.model:
            args.append(f"--model={F.model}")
        proc = subprocess.run(args, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not lines:
            sys.exit(f"setting {setting}: the worker failed\n{proc.stderr[-3000:]}")
        results.append(json.loads(lines[-1][len("RESULT "):]))
        print(f"{setting}: done", file=sys.stderr, flush=True)
    base = next((r for r in results if r["setting"] == "none"), None)
    print(f"model: {F.model or 'embedded SmolLM2-135M-Instruct (Q4_1 GGUF)'}, dtype {F.dtype}, "
          f"{results[0]['scored_tokens']} scored tokens ({F.num_windows} windows of {F.window})")
    print("| setting | perplexity | vs none | argmax agreement | greedy agreement | weights MiB | "
          "peak RSS MiB | RSS MiB | decode tok/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if base is not None:
            r["ppl_change"] = r["ppl"] / base["ppl"] - 1
            r["argmax_agreement"] = agreement(r["argmax"], base["argmax"])
            r["greedy_agreement"] = agreement(r["continuation"], base["continuation"], prefix=True)
        rel = f"{100 * r['ppl_change']:+.2f}%" if base else "-"
        agree = f"{100 * r['argmax_agreement']:.1f}%" if base else "-"
        greedy = f"{100 * r['greedy_agreement']:.0f}%" if base else "-"
        print(f"| {r['setting']} | {r['ppl']:.3f} | {rel} | {agree} | {greedy} | {r['weight_mib']:.1f} | "
              f"{r['peak_rss_mib']:.0f} | {r['rss_mib']:.0f} | {r['decode_tok_s']:.1f} |")
    if F.output:
        with open(F.output, "w") as f:
            json.dump([{k: v for k, v in r.items() if k not in ("argmax", "continuation")} for r in results], f,
                      indent=1)


if __name__ == "__main__":
    app.run(main)
