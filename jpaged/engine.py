"""LLMEngine: the loop. add_request / step / abort_request / has_unfinished_requests.

Each step: the scheduler picks tokens per request under the budget, the model runner runs the
jitted step, and the results are appended here, stop conditions checked, finished requests freed.
"""
import itertools
import os
import time

import jax
import jax.numpy as jnp

from jpaged import beam_search, sharding
from jpaged.config import EngineConfig
from jpaged.core.kv_cache_manager import KVCacheManager, cdiv
from jpaged.core.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from jpaged.detokenizer import IncrementalDetokenizer
from jpaged.loading import load_model
from jpaged.model_runner import ModelRunner
from jpaged.outputs import CompletionOutput, RequestOutput
from jpaged.request import Request, Sequence
from jpaged.sampling_params import BeamSearchParams, SamplingParams

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def enable_compilation_cache(path: str | None) -> None:
    """JAX's persistent compilation cache, so a second start compiles nothing."""
    if jax.config.jax_compilation_cache_dir:
        return
    path = path or os.path.join(os.path.expanduser("~"), ".cache", "jpaged", "jax")
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


class LLMEngine:
    def __init__(self, config: EngineConfig, model=None, tokenizer=None, devices=None):
        """Loads ``config.model`` (or serves ``model``, an NNX model already in memory) onto a mesh
        of ``tensor_parallel_size`` devices (the first ones, or ``devices``)."""
        self.config = config
        self.mesh = sharding.make_mesh(config.tensor_parallel_size, devices)
        enable_compilation_cache(config.compilation_cache_dir)
        platform = jax.default_backend()
        self.dtype = DTYPES[config.dtype] if config.dtype != "auto" else (
            jnp.float32 if platform == "cpu" else jnp.bfloat16)
        backend = config.attention_backend
        self.attention_backend = backend if backend != "auto" else ("pallas" if platform in ("tpu", "gpu") else "xla")
        model, self.tokenizer = self._load(model, tokenizer)
        mc = self.model_config = model.config
        sc = config.scheduler
        if sc.max_model_len is not None and sc.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len={sc.max_model_len}: exceeds the model's "
                             f"max_position_embeddings={mc.max_position_embeddings}")
        self.max_model_len = sc.max_model_len or mc.max_position_embeddings
        tok = self.tokenizer
        self.eos_token_ids = tuple(mc.eos_token_ids) or (
            (tok.eos_token_id,) if tok is not None and tok.eos_token_id is not None else ())
        cc = config.cache
        self.num_blocks = self._num_blocks()
        if cc.allocator == "paged":
            self.kv_cache = KVCacheManager(self.num_blocks, cc.block_size, cc.enable_prefix_caching,
                                           cc.share_forked_blocks)
        else:  # a contiguous-reservation baseline, for the paper's comparisons
            from jpaged.core.reservation import ReservationKVCacheManager
            self.kv_cache = ReservationKVCacheManager(self.num_blocks, cc.block_size, mode=cc.allocator,
                                                      max_model_len=self.max_model_len)
        self.scheduler = Scheduler(sc, self.kv_cache, preemption_mode=cc.preemption_mode,
                                   swap_capacity_blocks=cc.swap_space_bytes // self._kv_bytes_per_block())
        self.runner = ModelRunner(model, self.kv_cache, num_blocks=self.num_blocks, dtype=self.dtype,
                                  mesh=self.mesh, seed=config.seed)
        self.requests: dict[str, Request] = {}
        self.detokenizers: dict[int, IncrementalDetokenizer] = {}
        self._arrivals = itertools.count()
        self.peak_kv_cache_usage = 0.0
        self._warm_up()

    # Set-up --------------------------------------------------------------------------------------
    def _load(self, model, tokenizer):
        """The model to serve: loaded from ``config.model`` (default: the embedded GGUF), or given."""
        if model is None:
            path = self.config.model
            if path is None:
                from jpaged.loading.gguf_loader import default_model_path
                path = default_model_path()
            model, _, tokenizer = load_model(path, dtype=self.dtype, mesh=self.mesh,
                                             attention_backend=self.attention_backend)
            return model, tokenizer
        c, tp = model.config, self.config.tensor_parallel_size
        if sharding.kv_head_replication(c.num_heads, c.num_kv_heads, tp) != 1:
            raise ValueError(f"tensor_parallel_size={tp}: an in-memory model with {c.num_kv_heads} KV heads "
                             "cannot be split; load it by path to replicate KV heads")
        return model, tokenizer

    def _kv_bytes_per_block(self) -> int:
        """Bytes of one block on one device (its heads' slice, KV-head replication included)."""
        mc = self.model_config
        heads_per_device = max(1, mc.num_kv_heads // self.config.tensor_parallel_size)
        return (2 * mc.num_layers * heads_per_device * self.config.cache.block_size * mc.head_dim
                * jnp.dtype(self.dtype).itemsize)

    def _num_blocks(self) -> int:
        cc, sc = self.config.cache, self.config.scheduler
        per_block = self._kv_bytes_per_block()
        if cc.num_kv_blocks is not None:
            return cc.num_kv_blocks
        if cc.kv_cache_memory_bytes is not None:
            budget = cc.kv_cache_memory_bytes
        else:
            stats = self.mesh.devices.flat[0].memory_stats() or {}
            if "bytes_limit" in stats:
                budget = int(stats["bytes_limit"] * cc.memory_utilization) - stats.get("bytes_in_use", 0)
            else:  # CPU: devices report no memory
                budget = cc.cpu_default_bytes
        n = min(budget // per_block, sc.max_num_seqs * cdiv(self.max_model_len, cc.block_size))
        if n < 1:
            raise ValueError(f"kv_cache_memory_bytes={budget}: too small for one KV block of {per_block} bytes")
        return int(n)

    def _warm_up(self) -> None:
        """Compiles the smallest step (one decode-shaped row) before the first request."""
        request = Request("warmup", None, [0], SamplingParams(temperature=0.0, max_tokens=1), -1)
        seq = request.seqs[0]
        self.kv_cache.allocate(seq, 1)
        self.runner.execute(SchedulerOutput(scheduled=[ScheduledRequest(request, 1)]))
        self.kv_cache.free(seq)

    # Requests ---------------------------------------------------------------------------------------
    def tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt: a dict prompt needs 'prompt_token_ids' or 'prompt'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: text given but the model has no tokenizer; pass token ids")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"prompt: expected str, list[int] or dict, got {type(prompt).__name__}")

    def validate(self, prompt_token_ids: list[int], params: SamplingParams | BeamSearchParams) -> None:
        """Every check on a request, before it touches the scheduler or the device."""
        if isinstance(params, (SamplingParams, BeamSearchParams)):  # vocabulary-dependent checks, grammars
            params.validate_for_vocab(self.model_config.vocab_size, self.tokenizer)
        if isinstance(params, BeamSearchParams):
            params = SamplingParams(n=params.beam_width, max_tokens=params.max_tokens)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
        params.validate()
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt: empty prompt (0 tokens)")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids: {bad[:5]} outside the vocabulary [0, {vocab})")
        if n >= self.max_model_len:
            raise ValueError(f"prompt: {n} tokens, but max_model_len={self.max_model_len} leaves no room "
                             f"to generate (the prompt must be shorter)")
        max_len = min(self.max_model_len, n + (params.max_tokens or self.max_model_len))
        bs = self.config.cache.block_size
        need = params.n * cdiv(max_len, bs)
        if need > self.num_blocks:
            raise ValueError(f"num_kv_blocks={self.num_blocks}: too small for this request, which may need "
                             f"{need} blocks of {bs} tokens ({params.n} x {max_len} tokens)")

    def add_request(self, request_id: str, prompt, sampling_params: SamplingParams | BeamSearchParams | None = None,
                    *, cache_salt: str | None = None) -> Request:
        """Queues a request; with `BeamSearchParams` it is a beam search (beams scheduled together)."""
        request_id = str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request_id={request_id!r}: already in use")
        params = sampling_params or SamplingParams()
        text, token_ids = self.tokenize(prompt)
        self.validate(token_ids, params)
        beam = None
        if isinstance(params, BeamSearchParams):
            max_new = min(params.max_tokens, self.max_model_len - len(token_ids))
            beam = beam_search.BeamState(params, max_new)
            params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=params.ignore_eos)
            params.logprobs = 2 * beam.params.beam_width  # each beam's top 2k next tokens
        if getattr(params, "prompt_logprobs", None) is not None:  # cached blocks are never run: skip the cache
            cache_salt = f"{cache_salt}/prompt_logprobs/{request_id}"
        request = Request(request_id, text, token_ids, params, next(self._arrivals),
                          eos_token_ids=self.eos_token_ids, cache_salt=cache_salt, beam=beam)
        request.seqs[0].max_tokens = min(params.max_tokens or self.max_model_len,
                                         self.max_model_len - len(token_ids))
        self.requests[request_id] = request
        self.scheduler.add_request(request)
        return request

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.requests.pop(str(request_id), None)
        if request is None:
            return None
        output = None
        if request.beam is not None:  # report the beams as they stand, then end the search
            output = self._beam_output(request, finish_reason="abort")
            request.beam.done = True
        for seq in request.live_seqs:
            seq.finish_reason = "abort"
        request.metrics.finished_time = time.time()
        self.scheduler.finish(request)
        self.runner.discard_swapped(s.seq_id for s in request.seqs)
        return output or self._output(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # The loop ---------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduling + model step; outputs of every request that advanced (or finished)."""
        sched = self.scheduler.schedule()
        self.peak_kv_cache_usage = max(self.peak_kv_cache_usage, self.kv_cache.usage())
        if not sched.scheduled:
            return []
        result = self.runner.execute(sched)
        for sr in sched.scheduled:
            for seq in sr.request.live_seqs:
                seq.num_computed_tokens += sr.num_new_tokens
        samples: dict[str, list] = {}
        for i, row in enumerate(result.rows):
            samples.setdefault(row.request.request_id, []).append(
                (row, int(result.tokens[i]), float(result.logprobs[i]), result.top_ids[i], result.top_logprobs[i]))
        for request_samples in samples.values():
            self._process_samples(request_samples)
        now = time.time()
        outputs = []
        for sr in sched.scheduled:
            request = sr.request
            if request.metrics.first_token_time is None and any(s.num_output_tokens for s in request.seqs):
                request.metrics.first_token_time = now
            if request.finished:
                request.metrics.finished_time = now
                self.scheduler.finish(request)
                self.requests.pop(request.request_id, None)
            else:
                for seq in request.seqs:  # a finished sample returns its blocks at once
                    if seq.finished and self.kv_cache.block_table(seq):
                        self.kv_cache.free(seq)
            outputs.append(self._output(request))
        return outputs

    def _process_samples(self, rows: list) -> None:
        """Appends one request's sampled tokens; forks the prompt sequence on its first n > 1 sample."""
        request = rows[0][0].request
        if request.beam is not None:
            return self._beam_step(request, rows)
        if len(rows) > 1 and len(request.seqs) == 1:
            parent = request.seqs[0]
            for row, *_ in rows[1:]:
                child = parent.fork(row.sample_index)
                self.kv_cache.fork(parent, child)
                request.seqs.append(child)
                row.seq = child
        for row, token, logprob, top_ids, top_lps in rows:
            self._append_token(request, row.seq, token, logprob, top_ids, top_lps)

    def _beam_step(self, request: Request, rows: list) -> None:
        """Picks the next beams; a beam chosen twice forks (shares blocks), one not chosen is freed."""
        state = request.beam
        width = 2 * state.params.beam_width
        candidates = [beam_search.Candidate(row.seq.cumulative_logprob + float(lp), row.seq, int(t))
                      for row, _, _, top_ids, top_lps in rows for t, lp in zip(top_ids[:width], top_lps[:width])]
        gen_len = rows[0][0].seq.num_output_tokens
        chosen = beam_search.select(state, candidates, gen_len, request.eos_token_ids)
        beams, kept = [], set()
        for c in chosen:  # fork first, from parents that have not taken their new token yet
            if id(c.parent) in kept:
                seq = c.parent.fork(len(beams))
                self.kv_cache.fork(c.parent, seq)
            else:
                kept.add(id(c.parent))
                seq = c.parent
            beams.append((seq, c))
        for seq in request.seqs:
            if id(seq) not in kept:
                self.kv_cache.free(seq)
        for i, (seq, c) in enumerate(beams):
            seq.token_ids.append(c.token)
            seq.cumulative_logprob, seq.index = c.score, i
        request.seqs = [seq for seq, _ in beams]

    def _append_token(self, request: Request, seq: Sequence, token: int, logprob: float, top_ids, top_lps):
        params = request.sampling_params
        seq.token_ids.append(token)
        seq.cumulative_logprob += logprob
        if params.logprobs is not None:
            entry = {token: logprob}
            entry.update({int(t): float(lp) for t, lp in zip(top_ids[:params.logprobs], top_lps[:params.logprobs])})
            seq.logprobs = (seq.logprobs or []) + [entry]
        if self.tokenizer is not None:
            detok = self.detokenizers.setdefault(
                seq.seq_id, IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens))
            old_len = len(seq.text)
            seq.text += detok.step(seq.output_token_ids)
            if params.stop and seq.num_output_tokens >= params.min_tokens:
                for stop in params.stop:
                    at = seq.text.find(stop, max(0, old_len - len(stop) + 1))
                    if at >= 0:
                        seq.text = seq.text[:at]
                        seq.finish_reason, seq.stop_reason = "stop", stop
                        break
        self._check_stop(request, seq, token)
        if seq.finished:
            self.detokenizers.pop(seq.seq_id, None)

    def _check_stop(self, request: Request, seq: Sequence, token: int) -> None:
        if seq.finished:
            return
        params = request.sampling_params
        if seq.num_output_tokens >= params.min_tokens:
            if token in params.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
                return
            if not params.ignore_eos and token in request.eos_token_ids:
                seq.finish_reason = "stop"
                return
        if (params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens) \
                or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"

    def _output(self, request: Request) -> RequestOutput:
        if request.beam is not None:
            return self._beam_output(request)
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
        if request.finished:
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
            text = self.tokenizer.decode(h.token_ids, skip_special_tokens=True) if self.tokenizer else ""
            completions.append(CompletionOutput(
                index=i, text=text, token_ids=list(h.token_ids), cumulative_logprob=h.cumulative_logprob,
                logprobs=None, finish_reason=reason, score=h.score))
        return RequestOutput(request.request_id, request.prompt, list(request.prompt_token_ids),
                             completions, finished, request.num_cached_tokens, request.metrics)

    # Metrics -----------------------------------------------------------------------------------------
    def get_metrics(self) -> dict:
        running_seqs = [s for r in self.scheduler.running for s in r.live_seqs]
        pool = self.kv_cache.pool
        return {
            "kv_cache_usage": self.kv_cache.usage(),
            "kv_cache_utilization": self.kv_cache.utilization(running_seqs),
            "peak_kv_cache_usage": self.peak_kv_cache_usage,
            "num_total_blocks": pool.num_blocks,
            "num_free_blocks": pool.num_free_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_swap_outs": self.scheduler.num_swap_outs,
            "prefix_cache_queries": self.kv_cache.prefix_cache_queries,
            "prefix_cache_hits": self.kv_cache.prefix_cache_hits,
            "num_compilations": self.runner.num_compilations,
            "block_size": self.config.cache.block_size,
            "attention_backend": self.attention_backend,
        }
