"""LLMEngine: the loop. add_request / step / abort_request / has_unfinished_requests.

One step reads top to bottom:
    out = scheduler.schedule()                      # who runs, with which blocks (plain data)
    result = runner.execute(out)                    # copies, swaps, the jitted step, sampling
    advanced = scheduler.update_from_output(out, *result)   # tokens appended, forks, stops, frees
    then, here: detokenization, stop strings, RequestOutputs.
A step that raises fails only the requests it carried (finish_reason "error"); the engine goes on.
"""
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import jpaged_kernels
from jpaged import beam_search, sharding
from jpaged.config import DTYPES, EngineConfig, check_kv_cache_dtype
from jpaged.core.kv_cache_manager import KVCacheManager
from jpaged.core.scheduler import SampleRow, Scheduler, SchedulerOutput, ScheduledSeq
from jpaged.detokenizer import IncrementalDetokenizer
from jpaged.loading import load_model
from jpaged.model_runner import ModelRunner
from jpaged.outputs import CompletionOutput, RequestOutput
from jpaged.request import Request, Sequence
from jpaged.sampling_params import BeamSearchParams, SamplingParams
from jpaged.step_timing import StepTimings
from jpaged.utils import cdiv, release_free_host_memory

logger = logging.getLogger("jpaged")
if not logger.handlers:  # one line per event on stderr, as vLLM prints its start-up facts
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("jpaged: %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False

def enable_compilation_cache(path: str | None) -> None:
    """JAX's persistent compilation cache, so a second start compiles nothing."""
    if jax.config.jax_compilation_cache_dir:
        return
    path = path or os.path.join(os.path.expanduser("~"), ".cache", "jpaged", "jax")
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.05)


class LLMEngine:
    def __init__(self, config: EngineConfig, model=None, tokenizer=None, devices=None):
        """Loads ``config.model`` (or serves ``model``, an NNX model already in memory) onto a mesh
        of ``tensor_parallel_size`` devices (the first ones, or ``devices``)."""
        self.config = config
        if model is not None and config.quantization is not None:
            raise ValueError(f"quantization={config.quantization!r}: applies to a model loaded by path; "
                             "an in-memory model is served with its parameters as they are")
        self.mesh = sharding.make_mesh(config.tensor_parallel_size, devices)
        enable_compilation_cache(config.compilation_cache_dir)
        platform = jax.default_backend()
        self.dtype = DTYPES[config.dtype] if config.dtype != "auto" else (
            jnp.float32 if platform == "cpu" else jnp.bfloat16)
        backend = config.attention_backend
        self.attention_backend = backend if backend != "auto" else ("pallas" if platform in ("tpu", "gpu") else "xla")
        kv_name = config.cache.kv_cache_dtype
        check_kv_cache_dtype(kv_name, self.attention_backend, platform,
                             getattr(self.mesh.devices.flat[0], "compute_capability", None))
        # The KV pages' dtype: the model's ("auto"), or 8-bit with a scale per (token, kv head).
        self.kv_cache_dtype = self.dtype if kv_name == "auto" else jpaged_kernels.KV_DTYPES[kv_name]
        model, self.tokenizer = self._load(model, tokenizer)
        release_free_host_memory()
        mc = self.model_config = model.config
        sc, cc = config.scheduler, config.cache
        if sc.max_model_len is not None and sc.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len={sc.max_model_len}: exceeds the model's "
                             f"max_position_embeddings={mc.max_position_embeddings}")
        self.max_model_len = sc.max_model_len or mc.max_position_embeddings
        tok = self.tokenizer
        self.eos_token_ids = tuple(mc.eos_token_ids) or (
            (tok.eos_token_id,) if tok is not None and tok.eos_token_id is not None else ())
        self.num_blocks = self._num_blocks()
        if cc.allocator == "paged":
            self.kv_cache = KVCacheManager(self.num_blocks, cc.block_size, cc.enable_prefix_caching,
                                           cc.share_forked_blocks)
        else:  # a contiguous-reservation baseline, for the paper's comparisons
            from jpaged.core.reservation import ReservationKVCacheManager
            self.kv_cache = ReservationKVCacheManager(self.num_blocks, cc.block_size, mode=cc.allocator,
                                                      max_model_len=self.max_model_len)
        self.scheduler = Scheduler(sc, self.kv_cache, max_model_len=self.max_model_len,
                                   preemption_mode=cc.preemption_mode,
                                   swap_capacity_blocks=cc.swap_space_bytes // self._kv_bytes_per_block())
        self.runner = ModelRunner(model, num_blocks=self.num_blocks, block_size=cc.block_size,
                                  dtype=self.dtype, mesh=self.mesh, seed=config.seed,
                                  max_num_seqs=sc.max_num_seqs, max_model_len=self.max_model_len,
                                  kv_cache_dtype=self.kv_cache_dtype,
                                  max_decode_window=sc.num_scheduler_steps)
        self.requests: dict[str, Request] = {}
        self.peak_kv_cache_usage = 0.0
        self.num_failed_steps = 0
        self._warm_up()
        self.step_timings = StepTimings()  # of the steps since start

    # Set-up --------------------------------------------------------------------------------------
    def _load(self, model, tokenizer):
        """The model to serve: loaded from ``config.model`` (default: the embedded GGUF), or given."""
        if model is None:
            path = self.config.model
            if path is None:
                from jpaged.loading.gguf_loader import default_model_path
                path = default_model_path()
            model, _, tokenizer = load_model(path, dtype=self.dtype, mesh=self.mesh,
                                             attention_backend=self.attention_backend,
                                             quantization=self.config.quantization)
            return model, tokenizer
        c, tp = model.config, self.config.tensor_parallel_size
        if sharding.kv_head_replication(c.num_heads, c.num_kv_heads, tp) != 1:
            raise ValueError(f"tensor_parallel_size={tp}: an in-memory model with {c.num_kv_heads} KV heads "
                             "cannot be split; load it by path to replicate KV heads")
        return model, tokenizer

    def _kv_bytes_per_block(self) -> int:
        """Bytes of one block on one device (its heads' slice, KV-head replication included), scales
        of 8-bit pages included."""
        mc = self.model_config
        heads_per_device = max(1, mc.num_kv_heads // self.config.tensor_parallel_size)
        return (2 * mc.num_layers * heads_per_device * self.config.cache.block_size
                * jpaged_kernels.quant.bytes_per_row(mc.head_dim, self.kv_cache_dtype))

    def _num_blocks(self) -> int:
        """Pool size: ``num_kv_blocks``, else a byte budget (``kv_cache_memory_bytes``, else the
        device's free memory x ``memory_utilization``, else on CPU ``cpu_default_bytes``), never
        more than ``max_num_seqs`` sequences of ``max_model_len`` tokens could use."""
        cc, sc = self.config.cache, self.config.scheduler
        per_block = self._kv_bytes_per_block()
        if cc.num_kv_blocks is not None:
            n = cc.num_kv_blocks
        else:
            if cc.kv_cache_memory_bytes is not None:
                budget, source = cc.kv_cache_memory_bytes, "kv_cache_memory_bytes"
            else:
                stats = self.mesh.devices.flat[0].memory_stats() or {}
                if "bytes_limit" in stats:
                    budget = int(stats["bytes_limit"] * cc.memory_utilization) - stats.get("bytes_in_use", 0)
                    source = f"memory_utilization={cc.memory_utilization}"
                else:  # CPU: devices report no memory
                    budget, source = cc.cpu_default_bytes, "the CPU default"
            n = min(budget // per_block, sc.max_num_seqs * cdiv(self.max_model_len, cc.block_size))
            if n < 1:
                raise ValueError(f"kv_cache_memory_bytes={budget}: too small for one KV block of {per_block} bytes")
        kv_dtype = jnp.dtype(self.kv_cache_dtype).name
        if jpaged_kernels.quant.is_quantized(self.kv_cache_dtype):
            kv_dtype += f" + {jnp.dtype(jpaged_kernels.SCALE_DTYPE).name} scales"
        logger.info("KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB per device (%s); %s, %d bytes "
                    "per token per device; set num_kv_blocks or kv_cache_memory_bytes to change it",
                    n, cc.block_size, n * cc.block_size, n * per_block / 2**20,
                    "num_kv_blocks" if cc.num_kv_blocks is not None else source, kv_dtype,
                    per_block // cc.block_size)
        return int(n)

    def _warm_up(self) -> None:
        """Compiles the smallest step; with ``precompile``, every step shape the settings allow.

        Dummy steps write into block 0 (free: nothing reads it before its owner writes it); a
        step's shapes depend only on its token count, sampled rows and sampling options
        (`ModelRunner.buckets`), so one step per token bucket, then the logits and sampler of each
        row count (greedy and sampled, without penalties or filters), cover the steady state.
        """
        start = time.perf_counter()
        runner = self.runner
        sc = self.config.scheduler
        max_tokens = sc.max_num_batched_tokens if self.config.precompile else 1
        request = Request("warmup", None, [0], SamplingParams(temperature=0.0, max_tokens=1))
        for t_pad in runner.token_buckets(max_tokens):
            runner.execute(self._dummy_step(request, t_pad))
        if self.config.precompile:
            runner.compile_heads(max_tokens, sc.max_num_seqs)
            if sc.num_scheduler_steps > 1:
                runner.compile_decode_windows(sc.max_num_seqs)
            logger.info("precompiled %d step shapes in %.1f s", runner.num_compilations,
                        time.perf_counter() - start)

    def _dummy_step(self, request: Request, num_tokens: int) -> SchedulerOutput:
        """A step of ``num_tokens`` tokens in as few sequences as ``max_model_len`` allows, all in
        block 0."""
        seq = request.seqs[0]
        per_seq = min(num_tokens, self.max_model_len)
        lengths = [per_seq] * (num_tokens // per_seq) + ([num_tokens % per_seq] if num_tokens % per_seq else [])
        bs = self.config.cache.block_size
        seqs = [ScheduledSeq([0] * n, 0, [0] * cdiv(n, bs)) for n in lengths]
        return SchedulerOutput(seqs=seqs, sample_rows=[SampleRow(request, seq, 0, 0)])

    # Requests ---------------------------------------------------------------------------------------
    def tokenize(self, prompt) -> tuple[str | None, list[int], str | None]:
        """(text or None, token ids, cache_salt or None) of a prompt in any accepted form."""
        salt = None
        if isinstance(prompt, dict):
            salt = prompt.get("cache_salt")
            if salt is not None and not isinstance(salt, str):
                raise ValueError(f"cache_salt: expected a string, got {type(salt).__name__}")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._token_ids(prompt["prompt_token_ids"]), salt
            if "prompt" not in prompt:
                raise ValueError("prompt: a dict prompt needs 'prompt_token_ids' or 'prompt'")
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: text given but the model has no tokenizer; pass token ids")
            return prompt, self.tokenizer.encode(prompt), salt
        if isinstance(prompt, (list, tuple)) or hasattr(prompt, "tolist"):
            return None, self._token_ids(prompt), salt
        raise ValueError(f"prompt: expected str, list[int] or dict, got {type(prompt).__name__}")

    @staticmethod
    def _token_ids(ids) -> list[int]:
        """Token ids as Python ints (numpy integers accepted; bools, floats and strings are not)."""
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        bad = [t for t in ids if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer))]
        if bad:
            raise ValueError(f"prompt_token_ids: {bad[:5]!r} are not integer token ids")
        return [int(t) for t in ids]

    def validate(self, prompt_token_ids: list[int], params: SamplingParams | BeamSearchParams) -> None:
        """Every check on a request, before it touches the scheduler or the device."""
        if not isinstance(params, (SamplingParams, BeamSearchParams)):
            raise ValueError(f"sampling_params: expected SamplingParams or BeamSearchParams, "
                             f"got {type(params).__name__}")
        params.validate()
        vocab = self.model_config.vocab_size
        params.validate_for_vocab(vocab, self.tokenizer)  # ids, logprobs, beam width; grammars compiled
        if isinstance(params, BeamSearchParams):
            params = SamplingParams(n=params.beam_width, max_tokens=params.max_tokens)
        sc = self.config.scheduler
        if params.n > sc.max_num_seqs:
            raise ValueError(f"max_num_seqs={sc.max_num_seqs}: smaller than the request's {params.n} "
                             "sequences (n or beam_width), which must run in one step")
        if params.n > sc.max_num_batched_tokens:
            raise ValueError(f"max_num_batched_tokens={sc.max_num_batched_tokens}: smaller than the request's "
                             f"{params.n} sequences (n or beam_width), which each need a token per step")
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt: empty prompt (0 tokens)")
        bad = [t for t in prompt_token_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
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
        """Queues a request; with `BeamSearchParams` it is a beam search (beams scheduled together).

        ``prompt`` may carry its own ``cache_salt`` (``{"prompt_token_ids": ..., "cache_salt": ...}``).
        """
        request_id = str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request_id={request_id!r}: already in use")
        params = SamplingParams() if sampling_params is None else sampling_params
        text, token_ids, salt = self.tokenize(prompt)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt: expected a string, got {type(cache_salt).__name__}")
        self.validate(token_ids, params)
        beam = None
        if isinstance(params, BeamSearchParams):
            max_new = min(params.max_tokens, self.max_model_len - len(token_ids))
            beam = beam_search.BeamState(params, max_new)
            params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=params.ignore_eos)
            params.logprobs = 2 * beam.params.beam_width  # each beam's top 2k next tokens
        cache_salt = cache_salt if cache_salt is not None else salt
        if params.prompt_logprobs is not None:  # cached blocks are never run: skip the cache
            cache_salt = f"{cache_salt}/prompt_logprobs/{request_id}"
        request = Request(request_id, text, token_ids, params, eos_token_ids=self.eos_token_ids,
                          cache_salt=cache_salt, beam=beam)
        request.seqs[0].max_tokens = min(params.max_tokens or self.max_model_len,
                                         self.max_model_len - len(token_ids))
        self.requests[request_id] = request
        self.scheduler.add_request(request)
        return request

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.requests.get(str(request_id))
        if request is None:
            return None
        output = None
        if request.beam is not None:  # report the beams as they stand, then end the search
            output = self._beam_output(request, finish_reason="abort")
            request.beam.done = True
        for seq in request.live_seqs:
            seq.finish_reason = "abort"
        self._end(request)
        return output or self._output(request)

    def _end(self, request: Request) -> None:
        """Forgets a request that has ended: its blocks, its host copy, its per-request state."""
        self.scheduler.finish(request)
        self.runner.discard_swapped(s.seq_id for s in request.seqs)
        for seq in request.seqs:
            seq.detokenizer = None
        request.metrics.finished_time = time.time()
        self.requests.pop(request.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # The loop ---------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduling + model step; outputs of every request that advanced (or ended)."""
        start = time.perf_counter()
        out = self.scheduler.schedule()
        scheduled = time.perf_counter()
        self.peak_kv_cache_usage = max(self.peak_kv_cache_usage, self.kv_cache.usage())
        if not out.requests:
            return self._fail_unschedulable()
        num_steps = self.scheduler.plan_decode_window(out, self.config.scheduler.num_scheduler_steps)
        try:
            results = self.runner.execute_window(out, num_steps) if num_steps > 1 else [self.runner.execute(out)]
        except Exception as error:  # noqa: BLE001 -- any failure ends only this step's requests
            return self._fail_step(out, error)
        now = time.time()
        advanced: dict[int, Request] = {}  # each request once, with its state after the last step
        for i, result in enumerate(results):  # a decode window: its steps' tokens in order
            step, rows = (out, None) if i == 0 else self.scheduler.window_substep(out)
            if not step.requests:
                break
            pick = (lambda a: a) if rows is None else (lambda a: a[rows])  # noqa: E731
            for request, seqs in self.scheduler.update_from_output(
                    step, pick(result.tokens), pick(result.logprobs), pick(result.top_ids),
                    pick(result.top_logprobs), result.prompt_logprobs):
                if request.beam is None:
                    for seq in seqs:
                        self._detokenize(request, seq)
                if request.metrics.first_token_time is None and seqs:
                    request.metrics.first_token_time = now
                advanced[id(request)] = request
        outputs = []
        for request in advanced.values():
            if request.finished:
                self._end(request)
            outputs.append(self._output(request))
        prepare, device = results[0].prepare_seconds, results[0].device_seconds
        self.step_timings.add(sum(len(s.token_ids) for s in out.seqs) * num_steps, steps=num_steps,
                              schedule=scheduled - start, prepare=prepare, device=device,
                              post=time.perf_counter() - scheduled - prepare - device)
        return outputs

    def _fail_step(self, out: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        """Ends the step's requests with finish_reason "error"; the engine goes on with the rest.

        Blocks registered in the prefix cache this step were never written, so free cached blocks
        are forgotten; if the failure consumed the donated KV pool, a new pool is made and every
        running request recomputes.
        """
        logger.error("engine step failed; ending its %d request(s): %r", len(out.requests), error)
        self.num_failed_steps += 1
        outputs = [self._end_with_error(sr.request, repr(error)) for sr in out.requests]
        if self.runner.kv_pool_lost():
            self.scheduler.preempt_all()
            self.runner.reset_kv_pool()
        if hasattr(self.kv_cache.pool, "forget_free_blocks"):
            self.kv_cache.pool.forget_free_blocks()
        return outputs

    def _fail_unschedulable(self) -> list[RequestOutput]:
        """With nothing running, a waiting request that still cannot be scheduled never will be."""
        sched = self.scheduler
        if sched.running or not sched.waiting:
            return []
        request = sched.waiting[0]
        logger.error("request %s cannot be scheduled with these engine settings; ended", request.request_id)
        return [self._end_with_error(request, "cannot be scheduled with these engine settings")]

    def _end_with_error(self, request: Request, reason: str) -> RequestOutput:
        """Ends a request with finish_reason "error" (beams too) and returns its last output."""
        for seq in request.live_seqs:  # before a beam search is marked done: then it has none live
            seq.finish_reason, seq.stop_reason = "error", reason
        if request.beam is not None:
            request.beam.done = True
        self._end(request)
        return self._output(request)

    def _detokenize(self, request: Request, seq: Sequence) -> None:
        """Grows the sequence's text; a stop string ends it. A stop token's text is left out."""
        if self.tokenizer is None:
            return
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
            return
        for stop in params.stop:
            at = seq.text.find(stop, max(0, old_len - len(stop) + 1))
            if at >= 0:
                seq.text = seq.text[:at + len(stop)] if params.include_stop_str_in_output else seq.text[:at]
                self.scheduler.stop_sequence(request, seq, "stop", stop)
                return

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
            "num_running_requests": len(self.scheduler.running),
            "num_waiting_requests": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_swap_outs": self.scheduler.num_swap_outs,
            "prefix_cache_queries": self.kv_cache.prefix_cache_queries,
            "prefix_cache_hits": self.kv_cache.prefix_cache_hits,
            "num_compilations": self.runner.num_compilations,
            "num_failed_steps": self.num_failed_steps,
            "block_size": self.config.cache.block_size,
            "attention_backend": self.attention_backend,
        }
