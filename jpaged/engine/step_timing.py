"""Where an engine step's time goes: the host's parts and the wait for the device, summed, in all
and by kind of step (prompt or decode, and how many rows)."""
import dataclasses

PARTS = ("schedule", "prepare", "device", "post")
ROW_CLASSES = (1, 8, 16, 32, 64, 128, 256)  # decode steps by their most rows: the CPU matmul's classes, 9-16 one of its own
# every kind of step, in the order the breakdown lists them
KINDS = ("prompt/verification", "decode, 1 row", *(f"decode, <= {n} rows" for n in ROW_CLASSES[1:]),
         f"decode, > {ROW_CLASSES[-1]} rows")


def step_class(rows: int, tokens: int) -> str:
    """The kind of a step of ``rows`` sequences and ``tokens`` tokens: "prompt/verification"
    where some sequence runs more than one token (a prompt chunk, or proposed tokens verified),
    else "decode, <= N rows" for the least N of `ROW_CLASSES` that holds its rows ("decode, 1 row")."""
    if tokens > rows:
        return KINDS[0]
    return KINDS[1 + sum(rows > n for n in ROW_CLASSES)]


@dataclasses.dataclass
class StepTimings:
    """Seconds summed over ``steps`` engine steps.

    schedule: `Scheduler.schedule`. prepare: copies, swaps, the padded batch, attention metadata
    and sampling tensors on the host. device: from dispatching the step to its sampled tokens on
    the host (the device's work, plus dispatch; JAX runs the step asynchronously, so this is the
    time the host waits). post: `update_from_output`, detokenization, stop strings, outputs.
    by_class: `step_class` -> [model steps, seconds of all parts].
    """

    steps: int = 0
    tokens: int = 0
    schedule: float = 0.0
    prepare: float = 0.0
    device: float = 0.0
    post: float = 0.0
    by_class: dict = dataclasses.field(default_factory=dict)

    def add(self, tokens: int, steps: int = 1, kind: str | None = None, **seconds: float) -> None:
        """``steps`` model steps (a decode window runs several) with ``tokens`` tokens in all, of
        the kind ``kind`` (`step_class`; None: counted in the totals only)."""
        self.steps += steps
        self.tokens += tokens
        for part, value in seconds.items():
            setattr(self, part, getattr(self, part) + value)
        if kind is not None:
            entry = self.by_class.setdefault(kind, [0, 0.0])
            entry[0] += steps
            entry[1] += sum(seconds.values())

    def summary(self) -> str:
        """One line: ms per step and share of the total for each part."""
        total = sum(getattr(self, p) for p in PARTS) or 1.0
        n = max(self.steps, 1)
        parts = ", ".join(f"{p} {getattr(self, p) / n * 1e3:.2f} ms ({getattr(self, p) / total:.0%})"
                          for p in PARTS)
        return f"{self.steps} steps, {self.tokens / n:.1f} tokens/step: {parts}"

    def class_summary(self) -> list[str]:
        """One line per kind of step, prompt steps first, then decode steps by rows: model steps,
        ms per model step, seconds and share of all the steps' time."""
        total = sum(seconds for _, seconds in self.by_class.values()) or 1.0
        return [f"{kind}: {steps} model steps, {seconds / max(steps, 1) * 1e3:.1f} ms a step, {seconds:.2f} s "
                f"({seconds / total:.1%})" for kind, (steps, seconds) in sorted(self.by_class.items(),
                                                                             key=lambda kv: KINDS.index(kv[0]))]
