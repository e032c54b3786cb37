"""Where an engine step's time goes: the host's parts and the wait for the device, summed."""
import dataclasses

PARTS = ("schedule", "prepare", "device", "post")


@dataclasses.dataclass
class StepTimings:
    """Seconds summed over ``steps`` engine steps.

    schedule: `Scheduler.schedule`. prepare: copies, swaps, the padded batch, attention metadata
    and sampling tensors on the host. device: from dispatching the step to its sampled tokens on
    the host (the device's work, plus dispatch; JAX runs the step asynchronously, so this is the
    time the host waits). post: `update_from_output`, detokenization, stop strings, outputs.
    """

    steps: int = 0
    tokens: int = 0
    schedule: float = 0.0
    prepare: float = 0.0
    device: float = 0.0
    post: float = 0.0

    def add(self, tokens: int, steps: int = 1, **seconds: float) -> None:
        """``steps`` model steps (a decode window runs several) with ``tokens`` tokens in all."""
        self.steps += steps
        self.tokens += tokens
        for part, value in seconds.items():
            setattr(self, part, getattr(self, part) + value)

    def summary(self) -> str:
        """One line: ms per step and share of the total for each part."""
        total = sum(getattr(self, p) for p in PARTS) or 1.0
        n = max(self.steps, 1)
        parts = ", ".join(f"{p} {getattr(self, p) / n * 1e3:.2f} ms ({getattr(self, p) / total:.0%})"
                          for p in PARTS)
        return f"{self.steps} steps, {self.tokens / n:.1f} tokens/step: {parts}"
