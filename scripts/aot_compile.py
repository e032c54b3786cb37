"""Compiles every step shape of an engine for a TPU or GPU target ahead of time, without weights or
a device, with the real compilers (`jpaged.entrypoints.aot`).

  python scripts/aot_compile.py --flagfile=configs/llama3.1-8b-v5e-8.flags --topology=v5e:2x4
  python scripts/aot_compile.py --model=configs/models/qwen2.5-7b.json --gpu=h100 --max_model_len=8192
  python scripts/aot_compile.py --model=path/to/hf_dir --topology=v6e:2x2 --kv_cache_dtype=int8 --output_json=out.json

``--model``: an HF directory (its config.json), a model-config JSON (config.json fields) or a preset.
Every engine flag of ``scripts/generate.py`` applies. Prints OK or the compiler's error per step
shape, then per chip: weights, KV pool, temporaries, the KV blocks that fit under
``--memory_utilization`` of the chip's memory, the largest batch of ``max_model_len`` sequences, and
the compile time; then a roofline estimate (`jpaged.entrypoints.roofline`, from the chip's published
bandwidth and peak: never a measurement): per decode step shape the least step time and the most
output tok/s, and the most a deployment serves of 1,800 prompt / 128 output token requests. Exit status 1 if a step fails to compile or does not fit, 2 on a bad flag. The
compilers live in their own virtual environments (``scripts/setup_aot_compilers.sh``); run from the
main environment, the script restarts itself in the one its target needs.
"""
import dataclasses
import json
import os
import sys

from absl import app, flags

from jpaged.entrypoints import flag_help
from jpaged.entrypoints.engine_flags import define_engine_flags, llm_args

F = flags.FLAGS
define_engine_flags()
flags.DEFINE_string("topology", None, "TPU slice to compile for, e.g. v5e:2x4, v6e:2x2 (one chip: a device of 2x2), "
                    "v6e:4x4 (16 chips on 4 hosts), v5p:2x2x1")
flags.DEFINE_enum("gpu", None, ["h100", "h200", "a100"], "GPU to compile for (one host)")
flags.DEFINE_string("output_json", None, "Write every figure, per step shape and in total, to this file")
flags.DEFINE_enum("shapes", "all", ["all", "edges", "largest"],
                  "Step shapes to compile: all (every shape the engine precompiles), edges (the ends of each kind: "
                  "fewest and most tokens, greedy and sampled, mixed and decode-only) or largest (the sampled "
                  "step with the most tokens and the decode-only step with the most rows: what decides the fit)")


def fail(message) -> None:
    print(f"aot_compile.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def parse_flags(argv: list[str]) -> list[str]:
    """--help lists every flag, grouped; a bad flag is one line and exit status 2."""
    return flag_help.parse_flags(argv, "aot_compile.py", __doc__)


def target() -> tuple[str, str, str | None]:
    """(target name, platform, TPU topology or None) from --topology / --gpu."""
    if (F.topology is None) == (F.gpu is None):
        fail("give exactly one of --topology (a TPU slice) or --gpu")
    if F.gpu is not None:
        return F.gpu, "cuda", None
    name = F.topology.split(":")[0]
    if name not in ("v4", "v5e", "v5p", "v6e"):
        fail(f"--topology={F.topology}: expected v4, v5e, v5p or v6e followed by :shape, e.g. v5e:2x4")
    return name, "tpu", F.topology


def in_compiler_environment(platform: str) -> None:
    """Restarts this script in the compiler venv of ``platform`` unless its plugin is importable."""
    plugin = "libtpu" if platform == "tpu" else "jax_plugins.xla_cuda12"
    try:
        __import__(plugin)
        return
    except ImportError:
        pass
    venv = os.path.join(os.environ.get("JPAGED_AOT_DIR", os.path.expanduser("~/.cache/jpaged/aot")),
                        "tpu" if platform == "tpu" else "gpu")
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        fail(f"no {platform} compiler here: run `bash scripts/setup_aot_compilers.sh` first (expected {venv})")
    env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="0")
    env.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")  # libtpu's host warnings; no TPU is used
    os.execve(python, [python, *sys.argv], env)


def model_config(model: str | None):
    from jpaged.loading import hf_checkpoint, presets
    from jpaged.utils import read_json

    if model is None:
        fail("--model: give an HF directory, a model-config JSON or a preset (the weights are not needed)")
    if model.endswith(".json") and os.path.isfile(model) and "architectures" in read_json(model):
        return hf_checkpoint.model_config(read_json(model), model)
    path, _ = presets.resolve(model, {})
    if path is not None and os.path.isdir(path):
        return hf_checkpoint.model_config(hf_checkpoint.read_config(path), os.path.join(path, "config.json"))
    fail(f"--model={model}: not an HF directory, a model-config JSON (config.json fields) or a preset of one")


class StepReport:
    """The total up front, then a line per step shape: its outcome, ``[k/N, ~T s left]``."""

    def __init__(self):
        self.total, self.done, self.seconds = 0, 0, 0.0

    def planned(self, total: int) -> None:
        self.total = total
        print(f"compiling {total} step shapes (after a probe of the largest one, which sizes the KV pool)",
              flush=True)

    def step(self, step) -> None:
        from jpaged.progress import eta_seconds

        self.done, self.seconds = self.done + 1, self.seconds + step.seconds
        memory = step.memory.get("temp_size_in_bytes")
        detail = f"temp {mib(memory)}" if step.ok and memory is not None else step.error.replace("\n", " | ")
        spills = f", {len(step.spills)} register spills" if step.spills else ""
        left = eta_seconds(self.done, self.total, self.seconds)  # the pace of the compiles so far
        print(f"{'OK  ' if step.ok else 'FAIL'} {step.name}: {step.seconds:.1f} s, {detail}{spills} "
              f"[{self.done}/{self.total}, ~{left:.0f} s left]", flush=True)


def mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def roofline_lines(estimate: dict) -> str:
    """The summary's roofline estimate: a line per decode step shape, one for the workload."""
    lines = [f"\nroofline ({estimate['label']}; {estimate['chip']}: {estimate['hbm_bytes_per_s'] / 1e9:,.0f} GB/s, "
             f"{estimate['peak_flops'] / 1e12:,.0f} TFLOP/s, {estimate['source']}):"]
    for s in estimate["decode_steps"]:
        lines.append(f"  decode rows={s['rows']} at context {s['context']}: reads {mib(s['bytes'])}, "
                     f"{s['flops'] / 1e9:,.1f} GFLOP per chip -> step >= {s['min_step_ms']:.2f} ms ({s['bound_by']}), "
                     f"<= {s['max_output_tokens_per_s']:,.0f} output tok/s")
    w = estimate["workload"]
    if w["batch"]:
        lines.append(f"  workload {w['prompt_tokens']} prompt / {w['output_tokens']} output tokens, {w['batch']} "
                     f"requests at once: <= {w['output_tokens_per_s']:,.0f} output tok/s, "
                     f"<= {w['requests_per_s']:.2f} req/s")
    else:
        lines.append(f"  workload {w['prompt_tokens']} prompt / {w['output_tokens']} output tokens: {w['note']}")
    return "\n".join(lines)


def main(argv):
    del argv
    name, platform, topology = target()
    in_compiler_environment(platform)
    from jpaged.entrypoints import aot
    from jpaged.config_resolution import engine_config

    model, kwargs = llm_args()
    try:
        mc = model_config(model)
        config = engine_config(None, **kwargs)
    except ValueError as e:
        fail(e)

    report = StepReport()
    try:
        result = aot.compile_engine(mc, config, name, topology=topology, shapes=F.shapes, progress=report.step,
                                    on_plan=report.planned)
    except ValueError as e:  # a setting the compile cannot honour, found before any step compiles
        fail(e)
    print(f"\n{result.target}, {result.num_devices} chip(s) of {mib(result.hbm_bytes)}, {result.attention_backend} "
          f"attention; per chip: weights "
          f"{mib(result.weight_bytes)}, KV pool {result.num_blocks} blocks x {result.kv_bytes_per_block} bytes = "
          f"{mib(result.kv_pool_bytes)}, "
          f"{f'recurrent states {mib(result.state_pool_bytes)}, ' if result.state_pool_bytes else ''}temporaries up to "
          f"{mib(result.max_temp_bytes)}, code "
          f"{mib(result.generated_code_bytes)}; {result.max_batch_at_max_model_len} sequences of max_model_len "
          f"fit; {sum(s.ok for s in result.steps)} of {len(result.steps)} step shapes compiled in "
          f"{result.compile_seconds:.0f} s; {'fits' if result.fits else 'DOES NOT FIT'}"
          f"{result.pool_note(config.scheduler.max_num_seqs)}")
    print(roofline_lines(result.roofline))
    if F.output_json:
        with open(F.output_json, "w") as f:
            json.dump(dataclasses.asdict(result) | {"ok": result.ok, "fits": result.fits}, f, indent=1)
    return 0 if result.ok and result.fits and result.num_blocks > 0 else 1


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
