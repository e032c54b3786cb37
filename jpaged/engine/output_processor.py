"""Output processing: new tokens -> text, stop strings, `RequestOutput`s.

`process` grows each advanced sequence's text (incremental detokenization, its state on the
sequence) and finds stop strings; it returns the sequences a stop string ended, for the engine to
hand to the scheduler. `output` builds a request's `RequestOutput` (beam searches: their
hypotheses, best first).
"""
from jpaged.core.request import Request, Sequence
from jpaged.engine.detokenizer import IncrementalDetokenizer
from jpaged.outputs import CompletionOutput, RequestOutput
from jpaged.sample import beam_search


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def process(self, advanced: list[tuple[Request, list[Sequence]]]) -> list[tuple[Request, Sequence, str]]:
        """Detokenizes every advanced sequence; returns (request, sequence, stop string) for each
        sequence whose text now contains one of its stop strings (cut from its text)."""
        stops = []
        for request, seqs in advanced:
            if request.beam is not None or self.tokenizer is None:
                continue
            for seq in seqs:
                stop = self._detokenize(request, seq)
                if stop is not None:
                    stops.append((request, seq, stop))
        return stops

    def _detokenize(self, request: Request, seq: Sequence) -> str | None:
        """Grows the sequence's text; the stop string it now holds, if any. A stop token's text is
        left out."""
        params = request.sampling_params
        if seq.detokenizer is None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        ids = seq.output_token_ids
        if seq.finish_reason == "stop" and not isinstance(seq.stop_reason, str) \
                and not params.include_stop_str_in_output:
            ids = ids[:-1]
        old_len = len(seq.text)
        seq.text += seq.detokenizer.step(ids)
        if not params.stop or seq.num_output_tokens < params.min_tokens or seq.finish_reason == "stop":
            return None
        for stop in params.stop:
            at = seq.text.find(stop, max(0, old_len - len(stop) + 1))
            if at >= 0:
                seq.text = seq.text[:at + len(stop)] if params.include_stop_str_in_output else seq.text[:at]
                return stop
        return None

    def output(self, request: Request, finish_reason: str | None = None) -> RequestOutput:
        """The request's output as it stands; ``finish_reason`` (beam searches): report the running
        beams as finished with it (an abort)."""
        if request.beam is not None:
            return self._beam_output(request, finish_reason)
        completions = [CompletionOutput(index=s.index, text=s.text, token_ids=list(s.output_token_ids),
                                        cumulative_logprob=s.cumulative_logprob, logprobs=s.logprobs,
                                        finish_reason=s.finish_reason, stop_reason=s.stop_reason)
                       for s in request.seqs]
        return RequestOutput(request.request_id, request.prompt, list(request.prompt_token_ids),
                             completions, request.finished, request.num_cached_tokens, request.metrics,
                             request.prompt_logprobs)

    def _beam_output(self, request: Request, finish_reason: str | None = None) -> RequestOutput:
        """Finished hypotheses best first (the running beams while the search goes on, or if aborted)."""
        finished = request.finished or finish_reason is not None
        if request.finished and request.beam.finished:
            hyps = request.beam.finished
        else:
            hyps = [beam_search.Hypothesis(s.cumulative_logprob, s.cumulative_logprob, s.output_token_ids)
                    for s in request.seqs]
        completions = []
        for i, h in enumerate(hyps):
            if finish_reason is None and finished:
                ended_by_eos = bool(h.token_ids) and h.token_ids[-1] in request.eos_token_ids \
                    and not request.beam.params.ignore_eos
                reason = "stop" if ended_by_eos else "length"
            else:
                reason = finish_reason
            if request.seqs and request.seqs[0].finish_reason == "error":
                reason = "error"
            text = self.tokenizer.decode(h.token_ids, skip_special_tokens=True) if self.tokenizer else ""
            completions.append(CompletionOutput(
                index=i, text=text, token_ids=list(h.token_ids), cumulative_logprob=h.cumulative_logprob,
                logprobs=None, finish_reason=reason, score=h.score))
        return RequestOutput(request.request_id, request.prompt, list(request.prompt_token_ids),
                             completions, finished, request.num_cached_tokens, request.metrics)
