"""Acceptance counters of speculative decoding, as ``get_metrics()`` reports them."""
from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Summed over verification steps since start. A *draft* is one sequence's proposals in one
    step (at least one token); each accepted proposal saves one decode step."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts whose token i was accepted

    def add(self, num_proposed: int, num_accepted: int) -> None:
        if num_proposed <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_proposed:
            self.accepted_per_position += [0] * (num_proposed - len(self.accepted_per_position))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def as_metrics(self) -> dict:
        """``spec_decode_*`` entries: counts, the acceptance rate (accepted / proposed tokens) and the
        mean accepted length (tokens a draft step produces: its accepted proposals plus the one
        token every step samples)."""
        return {"spec_decode_num_drafts": self.num_drafts,
                "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_acceptance_rate": self.num_accepted_tokens / max(self.num_draft_tokens, 1),
                "spec_decode_mean_accepted_length": 1 + self.num_accepted_tokens / max(self.num_drafts, 1),
                "spec_decode_accepted_per_position": list(self.accepted_per_position)}
