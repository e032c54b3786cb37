"""Where the KV cache memory goes: the vLLM paper's Figure 2, for paged and the Orca baselines.

  python scripts/memory_waste.py                                   # both workloads, all allocators
  python scripts/memory_waste.py --workload sharegpt-like --num_kv_blocks 1024 --out_dir docs

This is a simulation, not a model run: the real ``Scheduler`` drives the real KV cache manager
(``KVCacheManager`` for paged, ``ReservationKVCacheManager`` for max / pow2 / oracle) over the
workloads of ``scripts/workloads.py``, and each scheduled step appends one synthetic
token per sampling sequence instead of running the model. Memory decisions do not depend on token
values (no prefix caching, ``ignore_eos``), so the accounting is the engine's exactly; it takes
seconds instead of hours.

After every step during which some request is still waiting (the system is under memory
pressure), every KV slot of the pool is put in one class:

  token states   slots holding a computed token;
  reserved       held by a running sequence for tokens it will produce later;
  internal frag  held by a running sequence past its final length (never written);
  external frag  free, but in a hole too small for the next waiting request's reservation
                 (contiguous allocators only: a free paged block fits any request);
  free           free and usable (a paged pool's spare blocks, or room the scheduler did not
                 use because of its sequence or token limits).

Shares are reported as the paper's bars are: over the memory that is held or stranded
(everything but ``free``), summed over steps. The paged "reserved" and "internal" slots are the
unfilled tails of last blocks (the paper counts that tail as internal fragmentation).
"""
import os
from collections import Counter

from absl import app, flags

from bench_common import REPO_ROOT
from workloads import make_workload
from jpaged.config import SchedulerConfig
from jpaged.core.kv_cache_manager import KVCacheManager
from jpaged.core.scheduler import Scheduler
from jpaged.core.scheduler_output import StepResult
from jpaged.core.request import Request
from jpaged.sampling_params import SamplingParams

ALLOCATORS = ("paged", "max", "pow2", "oracle")
CLASSES = ("tokens", "reserved", "internal", "external", "free")
LABELS = {"tokens": "token states", "reserved": "reserved", "internal": "internal frag",
          "external": "external frag", "free": "free"}
PAPER_TOKEN_SHARE = {"max": "20.4%", "pow2": "26.8%", "oracle": "38.2%", "paged": "96.3%"}

F = flags.FLAGS


def define_flags() -> None:
    """The script's flags (defined when it runs, so that importing its functions defines none:
    tests import it beside modules that define --block_size, --seed, ...)."""
    flags.DEFINE_list("workload", ["sharegpt-like", "alpaca-like"], "Workloads from scripts/workloads.py")
    flags.DEFINE_list("allocator", list(ALLOCATORS), "Allocators to compare")
    flags.DEFINE_integer("num_requests", None, "Requests per workload (default: the workload's own)")
    flags.DEFINE_float("length_scale", 1.0, "Multiplies every prompt and output length (as benchmark_throughput)")
    flags.DEFINE_integer("num_kv_blocks", 1024, "Pool size in blocks, the same for every allocator")
    flags.DEFINE_integer("block_size", 16, "Tokens per block")
    flags.DEFINE_integer("max_model_len", 2048, "The model's maximum length (what `max` reserves)")
    flags.DEFINE_integer("max_num_seqs", 256, "Scheduler: sequences per step")
    flags.DEFINE_integer("max_num_batched_tokens", 2048, "Scheduler: tokens per step")
    flags.DEFINE_integer("vocab_size", 32000, "Vocabulary the prompts are drawn from (bench-llama's)")
    flags.DEFINE_integer("seed", 0, "Workload seed")
    flags.DEFINE_string("out_dir", os.path.join(REPO_ROOT, "docs"), "Where the PNG goes ('' for none)")


def make_kv_cache(allocator: str, num_blocks: int, block_size: int, max_model_len: int):
    if allocator == "paged":
        return KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
    from jpaged.core.reservation import ReservationKVCacheManager
    return ReservationKVCacheManager(num_blocks, block_size, mode=allocator, max_model_len=max_model_len)


def classify(kv, scheduler, final_len: dict[int, int]) -> Counter:
    """Slots of the pool by class, now (see the module docstring)."""
    bs = kv.block_size
    held = getattr(kv, "reserved_blocks", kv.block_table)  # a reservation counts whole
    c = Counter()
    for request in scheduler.running:
        for seq in request.live_seqs:
            allocated = len(held(seq)) * bs
            will_use = min(allocated, final_len[seq.seq_id])
            c["tokens"] += seq.num_computed_tokens
            c["reserved"] += will_use - seq.num_computed_tokens
            c["internal"] += allocated - will_use
    head = scheduler.waiting[0].live_seqs[0] if scheduler.waiting else None
    stranded = kv.external_fragmentation(head) if hasattr(kv, "external_fragmentation") else 0
    c["external"] += stranded * bs
    c["free"] += (kv.pool.num_free_blocks - stranded) * bs
    return c


def simulate(allocator: str, prompts, output_lens, *, num_kv_blocks: int, block_size: int = 16,
             max_model_len: int = 2048, max_num_seqs: int = 256, max_num_batched_tokens: int = 2048) -> dict:
    """Replays the workload through the scheduler; slot classes summed over loaded steps, and stats."""
    kv = make_kv_cache(allocator, num_kv_blocks, block_size, max_model_len)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                          max_model_len=max_model_len), kv, max_model_len=max_model_len)
    final_len = {}
    for i, (prompt, out) in enumerate(zip(prompts, output_lens)):
        out = min(out, max_model_len - len(prompt))
        request = Request(str(i), None, list(prompt), SamplingParams(max_tokens=out, ignore_eos=True))
        seq = request.seqs[0]
        seq.max_tokens = out
        final_len[seq.seq_id] = len(prompt) + out
        scheduler.add_request(request)
    totals, steps, batch, loaded_steps, loaded_batch = Counter(), 0, 0, 0, 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        if not out.requests:
            raise RuntimeError(f"{allocator}: the scheduler stalled (pool of {num_kv_blocks} blocks too small?)")
        steps += 1
        batch += len(out.requests)
        n = len(out.sample_rows)  # every sample row draws the synthetic token 0
        scheduler.update_from_output(out, StepResult([0] * n, [0.0] * n, [[]] * n, [[]] * n))
        if scheduler.waiting:
            totals += classify(kv, scheduler, final_len)
            loaded_steps += 1
            loaded_batch += len(out.requests)
    kv.pool.check_invariants()
    assert kv.pool.num_free_blocks == num_kv_blocks, "every block must be back after the drain"
    return {"slots": totals, "steps": steps, "mean_batch": batch / max(steps, 1),
            "loaded_batch": loaded_batch / max(loaded_steps, 1),
            "preemptions": scheduler.num_preemptions}


def shares(slots: Counter) -> dict[str, float]:
    """Each class as a share of the held or stranded memory (the paper's bars sum to 100%)."""
    held = sum(slots[k] for k in CLASSES if k != "free")
    return {k: slots[k] / held if held else 0.0 for k in CLASSES if k != "free"}


def free_share(slots: Counter) -> float:
    """Free, usable slots as a share of the whole pool (not waste: room the scheduler left)."""
    total = sum(slots.values())
    return slots["free"] / total if total else 0.0


def table(workload: str, results: dict[str, dict]) -> str:
    head = (f"{workload:<14} {'token states':>12} {'reserved':>9} {'internal':>9} {'external':>9} "
            f"{'free/pool':>9} {'paper tokens':>12} {'mean batch':>10} {'(loaded)':>8} {'steps':>6} {'preempt':>7}")
    lines = [head, "-" * len(head)]
    for name, r in results.items():
        s = shares(r["slots"])
        lines.append(f"{name:<14} {s['tokens']:>12.1%} {s['reserved']:>9.1%} {s['internal']:>9.1%} "
                     f"{s['external']:>9.1%} {free_share(r['slots']):>9.1%} {PAPER_TOKEN_SHARE[name]:>12} "
                     f"{r['mean_batch']:>10.1f} {r['loaded_batch']:>8.1f} "
                     f"{r['steps']:>6} {r['preemptions']:>7}")
    return "\n".join(lines)


def plot(all_results: dict[str, dict[str, dict]], path: str) -> None:
    """Stacked bars per allocator, one panel per workload (the paper's Figure 2)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"tokens": "#2b8a3e", "reserved": "#f2c14e", "internal": "#e8590c", "external": "#862e9c"}
    fig, axes = plt.subplots(1, len(all_results), figsize=(4.2 * len(all_results), 3.6), squeeze=False)
    for ax, (workload, results) in zip(axes[0], all_results.items()):
        names = list(results)
        bottom = [0.0] * len(names)
        for k, color in colors.items():
            vals = [100 * shares(results[n]["slots"])[k] for n in names]
            ax.bar(names, vals, bottom=bottom, color=color, label=LABELS[k], width=0.6)
            for i, v in enumerate(vals):
                if k == "tokens":
                    ax.text(i, v / 2, f"{v:.1f}", ha="center", va="center", color="white", fontsize=8)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_title(workload)
        ax.set_ylim(0, 100)
        ax.set_ylabel("KV cache (%)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(colors), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv):
    del argv
    for a in F.allocator:
        if a not in ALLOCATORS:
            raise app.UsageError(f"--allocator: {a!r} is not one of {ALLOCATORS}")
    all_results = {}
    for workload in F.workload:
        prompts, output_lens = make_workload(workload, F.vocab_size, F.num_requests, F.seed,
                                               F.length_scale)
        all_results[workload] = {a: simulate(a, prompts, output_lens, num_kv_blocks=F.num_kv_blocks,
                                             block_size=F.block_size, max_model_len=F.max_model_len,
                                             max_num_seqs=F.max_num_seqs,
                                             max_num_batched_tokens=F.max_num_batched_tokens)
                                 for a in F.allocator}
        print(f"\n{workload}: {len(prompts)} requests, pool {F.num_kv_blocks} blocks x {F.block_size} tokens, "
              f"max_model_len {F.max_model_len} (shares of held + stranded KV slots, summed over loaded steps)")
        print(table(workload, all_results[workload]))
    if F.out_dir:
        os.makedirs(F.out_dir, exist_ok=True)
        path = os.path.join(F.out_dir, "memory_waste.png")
        plot(all_results, path)
        print(f"\nwrote {path}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
