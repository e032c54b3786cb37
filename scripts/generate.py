"""Batch generation from the command line.

  python scripts/generate.py                                  # embedded SmolLM2-135M-Instruct
  python scripts/generate.py --prompt "Tell me a joke" --prompt "What is 2+2?" --temperature 0.7
  python scripts/generate.py --model path/to/hf_dir --prompts_file prompts.txt --max_tokens 128
  python scripts/generate.py --config smollm2-135m-instruct --max_num_seqs 32

Flags, sampling settings, the prompts file and the model path are checked before anything is loaded;
a problem is one line on stderr (``generate.py: error: ...``) and exit status 2.
"""
import time

PROCESS_START = time.time()  # before the imports, for the "since start" figure

import sys  # noqa: E402

from absl import app, flags  # noqa: E402

from jpaged.loading import presets  # noqa: E402  (no JAX import yet: checking flags stays fast)
from jpaged.logger import configure_logging  # noqa: E402
from jpaged.entrypoints.engine_flags import (define_engine_flags, define_sampling_flags, llm_args,  # noqa: E402
                                             sampling_params)
from jpaged.entrypoints import flag_help  # noqa: E402

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about paging memory.",
    "Explain in one sentence why the sky is blue.",
    "List three prime numbers.",
]
SAMPLING_DEFAULTS = {"temperature": 0.0, "max_tokens": 64}  # greedy, longer than SamplingParams' 16

F = flags.FLAGS
flags.DEFINE_multi_string("prompt", [], "A prompt (repeat for a batch)")
flags.DEFINE_string("prompts_file", None, "A file with one prompt per line")
flags.DEFINE_bool("chat", True, "Wrap prompts in the tokenizer's chat template when it has one")
flags.DEFINE_bool("print_outputs", True, "Print each completion")
define_sampling_flags(defaults=SAMPLING_DEFAULTS)  # every SamplingParams field
define_engine_flags()  # --model, --config and every engine setting (None = the preset's or the default)


def fail(message) -> None:
    """A user error: one line, exit status 2 (argparse's convention)."""
    print(f"generate.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def parse_flags(argv: list[str]) -> list[str]:
    """absl's parsing, with --help (grouped, every flag) exiting 0 and a bad flag answered in one line."""
    return flag_help.parse_flags(argv, "generate.py", __doc__)


def read_prompts() -> list[str]:
    """The --prompt flags, then the file's non-blank lines; the built-in prompts when neither is given."""
    prompts = list(F.prompt)
    if F.prompts_file is not None:
        try:
            with open(F.prompts_file) as f:
                from_file = [line.rstrip("\n") for line in f if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--prompts_file={F.prompts_file!r}: {getattr(e, 'strerror', None) or e}") from None
        if not from_file:
            raise ValueError(f"--prompts_file={F.prompts_file!r}: no prompts in it (empty or only blank lines)")
        prompts += from_file
    return prompts or DEFAULT_PROMPTS


def model_and_settings() -> tuple[str | None, dict]:
    """(--model or the --config preset's model, engine settings: the preset's, then the flags')."""
    _, settings = llm_args(F)
    if F.config is not None:
        preset = presets.load_preset(F.config)
        if preset is None:
            raise ValueError(f"--config={F.config!r}: not a preset (presets: {', '.join(presets.list_presets())})")
        preset = dict(preset)
        model = preset.pop("model", None)
        settings = {**preset, **settings}
        if F.model is None:
            return model, settings
    presets.resolve(F.model, settings)  # the model path or preset exists
    return F.model, settings


def summary(outputs, elapsed: float, metrics: dict) -> str:
    """One line: requests and sequences, tokens, throughput, first token, KV cache, compilations."""
    n_seqs = sum(len(o.outputs) for o in outputs)
    n_out = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    n_in = sum(len(o.prompt_token_ids) for o in outputs)
    what = f"{len(outputs)} request{'s' if len(outputs) != 1 else ''}"
    if n_seqs != len(outputs):
        what += f" ({n_seqs} sequences)"
    timed = [o.metrics for o in outputs if o.metrics is not None and o.metrics.first_token_time is not None]
    first = ""
    if timed:
        first_token = min(m.first_token_time for m in timed)
        first = (f"first token {first_token - min(m.arrival_time for m in timed):.2f} s after the first request "
                 f"({first_token - PROCESS_START:.1f} s after start), ")
    return (f"{what}, {n_in} prompt + {n_out} generated tokens in {elapsed:.2f} s: "
            f"{n_out / elapsed:.1f} output tok/s, {(n_in + n_out) / elapsed:.1f} total tok/s; {first}"
            f"{time.time() - PROCESS_START:.1f} s in all; "
            f"peak KV cache usage {metrics['peak_kv_cache_usage']:.1%} of {metrics['num_total_blocks']} blocks, "
            f"{metrics['num_preemptions']} preemptions, {metrics['num_compilations']} compilations")


def main(argv):
    configure_logging()
    if len(argv) > 1:
        fail(f"unexpected arguments {argv[1:]} (prompts go in --prompt or --prompts_file)")
    try:
        params = sampling_params(F)
        prompts = read_prompts()
        model, engine_kwargs = model_and_settings()
        from jpaged.config_resolution import engine_config  # imports JAX
        from jpaged.entrypoints.llm import LLM

        engine_config(model, **engine_kwargs)  # every engine setting valid; loads nothing
        llm = LLM(model, **engine_kwargs)
        tokenizer = llm.get_tokenizer()
        start = time.perf_counter()
        if F.chat and tokenizer is not None and tokenizer.chat_template:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=True)
        else:
            outputs = llm.generate(prompts, params, use_tqdm=True)
        elapsed = time.perf_counter() - start
    except (ValueError, OSError) as e:  # bad input, a missing or corrupt file
        fail(e)
    if F.print_outputs:
        for prompt, out in zip(prompts, outputs):
            print(f"\n>>> {prompt}")
            for c in out.outputs:
                tag = f"[{c.index + 1}/{len(out.outputs)}] " if len(out.outputs) > 1 else ""
                print(f"{tag}{c.text}  [{c.finish_reason}, {len(c.token_ids)} tokens]")
    print("\n" + summary(outputs, elapsed, llm.get_metrics()))


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
