"""Beam search inside the engine, with the selection rule of transformers' `generate(num_beams=k)`.

Each step every live beam contributes its top ``2k`` next tokens; the best ``2k`` candidates overall
are ranked by cumulative log-probability. Candidates that end (EOS or the length limit) among the
top ``k`` become finished hypotheses, scored ``logprob_sum / gen_len ** length_penalty``, of which
the best ``k`` are kept; the best ``k`` candidates that do not end are the next step's beams. The
search stops when no candidate continues or no running beam can beat the worst kept hypothesis
(transformers' default ``early_stopping=False`` heuristic).

This module decides; the engine applies the decision to block tables (a beam chosen twice is
forked and shares its parent's blocks, a beam not chosen is freed).
"""
from dataclasses import dataclass, field

from jpaged.sampling_params import BeamSearchParams


@dataclass
class Candidate:
    score: float      # cumulative log-probability including the new token
    parent: object    # the Sequence it extends
    token: int


@dataclass
class Hypothesis:
    score: float             # length-normalized
    cumulative_logprob: float
    token_ids: list[int]     # generated tokens only


@dataclass
class BeamState:
    params: BeamSearchParams
    max_new_tokens: int
    finished: list[Hypothesis] = field(default_factory=list)
    improvement_possible: bool = True
    done: bool = False


def select(state: BeamState, candidates: list[Candidate], gen_len: int, eos_token_ids) -> list[Candidate]:
    """One beam step: updates ``state.finished`` / ``state.done``; returns the beams to continue.

    ``gen_len`` is the number of tokens generated so far (before this step's token).
    """
    k = state.params.beam_width
    candidates = sorted(candidates, key=lambda c: -c.score)[:2 * k]
    new_len = gen_len + 1
    at_limit = new_len >= state.max_new_tokens

    def ends(c: Candidate) -> bool:
        return at_limit or (not state.params.ignore_eos and c.token in eos_token_ids)

    penalty = new_len ** state.params.length_penalty
    if state.improvement_possible:
        for c in candidates[:k]:
            if ends(c):
                state.finished.append(Hypothesis(c.score / penalty, c.score,
                                                 c.parent.output_token_ids + [c.token]))
        state.finished = sorted(state.finished, key=lambda h: -h.score)[:k]
    running = [c for c in candidates if not ends(c)][:k]
    if running and len(state.finished) == k:
        best_possible = running[0].score / penalty
        state.improvement_possible = best_possible > state.finished[-1].score
    state.done = not running or not state.improvement_possible
    return [] if state.done else running
