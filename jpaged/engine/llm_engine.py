"""LLMEngine: the loop. add_request / step / abort_request / has_unfinished_requests.

One step reads top to bottom:
    out = scheduler.schedule()                       # who runs, with which blocks (plain data)
    results = runner.execute(out)                    # swaps, copies, the jitted step, sampling
    advanced = scheduler.update_from_output(out, r)  # tokens appended, forks, stops, frees
    stops = output_processor.process(advanced)       # text, stop strings; the engine applies them
A step that raises fails only the requests it carried (finish_reason "error"); the engine goes on.
"""
import time

from jpaged.config import EngineConfig
from jpaged.core.request import Request
from jpaged.core.scheduler_output import SchedulerOutput
from jpaged.engine import startup
from jpaged.engine.input_processor import InputProcessor
from jpaged.engine.output_processor import OutputProcessor
from jpaged.engine.step_timing import StepTimings, step_class
from jpaged.logger import configure_logging, logger
from jpaged.outputs import RequestOutput
from jpaged.sampling_params import BeamSearchParams, SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig, model=None, tokenizer=None, devices=None):
        """Loads ``config.model`` (or serves ``model``, an NNX model already in memory) onto a mesh
        of ``tensor_parallel_size`` devices (the first ones, or ``devices``)."""
        configure_logging()
        self.config = config
        parts = startup.build(config, model, tokenizer, devices)
        self.mesh, self.dtype, self.kv_cache_dtype = parts.mesh, parts.dtype, parts.kv_cache_dtype
        self.attention_backend, self.model_config = parts.attention_backend, parts.model_config
        self.tokenizer, self.max_model_len, self.num_blocks = parts.tokenizer, parts.max_model_len, parts.num_blocks
        self.kv_cache, self.scheduler, self.runner = parts.kv_cache, parts.scheduler, parts.runner
        self.lora = parts.lora  # the LoRAManager with enable_lora, else None
        self.input_processor = InputProcessor(self.tokenizer, self.model_config.vocab_size, self.max_model_len,
                                              self.num_blocks, config.cache.block_size, config.scheduler,
                                              parts.eos_token_ids, config.speculative_config, parts.kv_layout,
                                              parts.kv_bytes_per_block, parts.max_model_len_note)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.peak_kv_cache_usage = 0.0
        self.num_failed_steps = 0
        self.step_timings = StepTimings()  # of the steps since start
        self.weights_version = 0  # update_weights calls so far
        self.sleep_level = 0      # 0: awake; 1 or 2 after sleep(level)
        self.paused = False       # set by the async engine's pause_generation: in-flight requests wait

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The tokens that end a sequence (unless ``ignore_eos``), given to each new request."""
        return self.input_processor.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids) -> None:
        self.input_processor.eos_token_ids = tuple(ids)

    @property
    def max_num_seqs(self) -> int:
        """Sequences that run at once (the scheduler's slots)."""
        return self.config.scheduler.max_num_seqs

    @property
    def requests(self) -> dict[str, Request]:
        """Every unfinished request, by id."""
        return self.scheduler.requests

    # Requests ---------------------------------------------------------------------------------------
    def process(self, request_id: str, prompt, sampling_params: SamplingParams | BeamSearchParams | None = None,
                *, cache_salt: str | None = None, lora_request=None) -> Request:
        """A validated request, not queued yet (`InputProcessor.process`; safe from any thread);
        ``lora_request``: the `LoRARequest` it runs with."""
        self._check_awake()
        return self.input_processor.process(request_id, prompt, sampling_params, cache_salt=cache_salt,
                                            lora_request=lora_request, lora=self.lora)

    def add_request(self, request_id: str | Request, prompt=None,
                    sampling_params: SamplingParams | BeamSearchParams | None = None, *,
                    cache_salt: str | None = None, lora_request=None) -> Request:
        """Queues a request (a `Request` from `process`, or an id with its prompt and parameters);
        with `BeamSearchParams` it is a beam search. ``prompt`` may carry its own ``cache_salt``."""
        self._check_awake()
        request = request_id if isinstance(request_id, Request) else self.process(
            request_id, prompt, sampling_params, cache_salt=cache_salt, lora_request=lora_request)
        self.scheduler.add_request(request)
        return request

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.requests.get(str(request_id))
        if request is None:
            return None
        output = None
        if request.beam is not None:  # report the beams as they stand, then end the search
            output = self.output_processor.output(request, finish_reason="abort")
            request.beam.done = True
        for seq in request.live_seqs:
            seq.finish_reason = "abort"
        self._end(request)
        return output or self.output_processor.output(request)

    def _end(self, request: Request) -> None:
        """Forgets a request that has ended: its blocks, its host copy, its per-request state."""
        self.scheduler.finish(request)
        for seq in request.seqs:
            seq.detokenizer = None
        request.metrics.finished_time = time.time()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # The loop ---------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduling + model step; outputs of every request that advanced (or ended)."""
        start = time.perf_counter()
        out = self.scheduler.schedule()
        scheduled = time.perf_counter()
        self.peak_kv_cache_usage = max(self.peak_kv_cache_usage, self.kv_cache.usage())
        if not out.requests:
            return self._fail_unschedulable()
        try:
            results = self.runner.execute(out)
        except Exception as error:  # noqa: BLE001 -- any failure ends only this step's requests
            return self._fail_step(out, error)
        now = time.time()
        advanced: dict[str, Request] = {}  # each request once, with its state after the last step
        for i, result in enumerate(results):  # a decode window: its steps' tokens in order
            for j in range(result.num_token_steps):  # a verification: its positions in order
                updates = self.scheduler.update_from_output(out, result, step_index=i + j)
                self.scheduler.stop_sequences(self.output_processor.process(updates))
                for request, seqs in updates:
                    if request.metrics.first_token_time is None and seqs:
                        request.metrics.first_token_time = now
                    advanced[request.request_id] = request
        outputs = []
        for request in advanced.values():
            if request.finished:
                self._end(request)
            outputs.append(self.output_processor.output(request))
        self.step_timings.add(out.num_tokens * len(results), steps=len(results),
                              kind=step_class(len(out.seqs), out.num_tokens), schedule=scheduled - start,
                              prepare=results[0].prepare_seconds, device=results[0].device_seconds,
                              post=time.perf_counter() - scheduled - results[0].prepare_seconds
                              - results[0].device_seconds)
        return outputs

    def _fail_step(self, out: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        """Ends the step's requests with finish_reason "error"; the engine goes on with the rest.

        Blocks registered in the prefix cache this step were never written, so free cached blocks
        are forgotten; if the failure consumed the donated KV pool, a new pool is made and every
        running request recomputes.
        """
        logger.error("engine step failed; ending its %d request(s): %r", len(out.requests), error)
        self.num_failed_steps += 1
        requests = [self.requests[r.request_id] for r in out.requests if r.request_id in self.requests]
        outputs = [self._end_with_error(request, repr(error)) for request in requests]
        if any(device_kv.lost() for device_kv in self.runner.kv_pools):  # the KV arrays on the device
            self.scheduler.preempt_all()
            for device_kv in self.runner.kv_pools:
                device_kv.reset()
        block_pool = self.kv_cache.pool  # the accounting of which block holds what
        if hasattr(block_pool, "forget_free_blocks"):
            block_pool.forget_free_blocks()
        if getattr(block_pool, "offload", None) is not None:
            block_pool.offload.drop_pending()
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
        return self.output_processor.output(request)

    # Training loops: new weights, sleep ---------------------------------------------------------------
    def _check_awake(self) -> None:
        if self.sleep_level:
            raise RuntimeError(f"the engine is asleep (sleep(level={self.sleep_level})): call wake_up() first")

    def check_idle(self, what: str, allow_paused: bool) -> None:
        """RuntimeError naming ``what`` while requests are in flight (unless paused and ``allow_paused``)."""
        if self.has_unfinished_requests() and not (allow_paused and self.paused):
            raise RuntimeError(f"{what}: {len(self.requests)} request(s) in flight; let them finish or abort them "
                               "first" + (" (or pause generation)" if allow_paused else ""))

    def update_weights(self, weights, draft_weights=None) -> None:
        """Serves new weights (an ``nnx.State`` of the engine's model, ``{hf_parameter_name: array}``
        or a checkpoint path; `jpaged.loading.weight_update`), cast and resharded onto the engine's
        dtypes and shardings, so nothing compiles. Refused while requests are in flight, unless the
        engine is paused (then they go on with the new weights). Every prefix-cache entry of the
        old weights is invalid at once. A mismatch is a ValueError and the old weights keep serving.

        ``draft_weights``: new weights of the speculative draft model (``method="draft_model"``), in
        any of the same forms, for the draft's architecture; checked and placed before the
        target's, and kept only if the target's are valid too. Without it the draft keeps its
        weights: its proposals are verified by the new target, so outputs stay the target's
        (fewer are accepted as the two drift apart)."""
        self.check_idle("update_weights", allow_paused=True)
        if self.config.quantization == "gguf":
            raise ValueError("update_weights: quantization='gguf' keeps a GGUF file's blocks, which new float "
                             "weights cannot become; build a new LLM (quantization=None or 'int8' re-quantize)")
        drafter = self.runner.drafter
        draft_leaves = None
        if draft_weights is not None:
            if drafter is None:
                raise ValueError("draft_weights: the engine has no draft model (speculative_config "
                                 "method='draft_model')")
            try:  # not donating the draft's old buffers: they serve on if the target's weights fail
                draft_leaves = drafter.weight_targets.new_leaves(draft_weights)
            except ValueError as e:
                raise ValueError(f"draft_weights: {e}") from None
        # every check before anything changes; the new leaves may take over the old ones' buffers
        leaves = self.runner.weight_targets.new_leaves(weights, old=self.runner.current_leaves())
        self.runner.load_weights(leaves)
        if draft_leaves is not None:
            drafter.load_weights(draft_leaves)
        self.weights_version += 1
        self.kv_cache.set_weights_version(self.weights_version)

    def update_lora(self, lora_request, tensors: dict, config: dict) -> None:
        """Serves a LoRA adapter given in memory (a trainer's): ``tensors`` ``{PEFT tensor name:
        array}`` and ``config`` the fields of ``adapter_config.json``, checked as a PEFT directory's
        are (`jpaged.lora.peft_adapter`); ``lora_request.lora_path`` only names it. The first call
        registers it; a later one with the same request replaces its factors: the device slot
        holding the old ones is rewritten in place now (`DeviceSlotWriter`, nothing compiles; an
        asleep engine forgets the slot and writes it at the adapter's next use), and prefix-cache
        blocks computed under them never match again (the factors' version is in the key). Refused
        while requests are in flight unless the engine is paused (they go on with the new factors)."""
        self.check_idle("update_lora", allow_paused=True)
        if self.lora is None:
            raise ValueError("lora_request: this engine serves no adapters (start it with enable_lora=True)")
        slot = self.lora.update(lora_request, tensors, config)
        if slot is None:
            return
        if self.sleep_level:
            self.lora.slots.forget_slot(slot)
        else:
            self.runner.write_lora_slots([(slot, lora_request)])

    def sleep(self, level: int = 1) -> None:
        """Frees the device: level 1 frees the KV pool and moves the weights to host memory, level 2
        drops the weights too (`update_weights` brings new ones). Requests are refused until
        `wake_up`; none may be in flight."""
        if level not in (1, 2):
            raise ValueError(f"level={level!r}: must be 1 or 2")
        self._check_awake()
        self.check_idle("sleep", allow_paused=False)
        block_pool = self.kv_cache.pool
        if hasattr(block_pool, "forget_free_blocks"):  # the blocks' contents are about to go
            block_pool.forget_free_blocks()
        self.runner.sleep(level)
        self.sleep_level = level

    def wake_up(self) -> None:
        """Restores the weights and a new, empty KV pool of the same size (the same executables)."""
        if not self.sleep_level:
            return
        self.runner.wake_up()
        self.sleep_level = 0

    # Metrics -----------------------------------------------------------------------------------------
    def get_metrics(self) -> dict:
        running_seqs = [s for r in self.scheduler.running for s in r.live_seqs]
        block_pool = self.kv_cache.pool
        return {
            "kv_cache_usage": self.kv_cache.usage(),
            "kv_cache_utilization": self.kv_cache.utilization(running_seqs),
            "peak_kv_cache_usage": self.peak_kv_cache_usage,
            "num_total_blocks": block_pool.num_blocks,
            "num_free_blocks": block_pool.num_free_blocks,
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
            **({} if self.scheduler.speculation is None else self.scheduler.speculation.stats.as_metrics()),
            **({} if getattr(block_pool, "offload", None) is None else block_pool.offload.metrics()),
            **({} if self.lora is None else self.lora.metrics()),
            **({} if self.scheduler.recurrent_state is None else {
                "num_state_slots": self.scheduler.recurrent_state.num_slots,
                "num_free_state_slots": self.scheduler.recurrent_state.num_free_slots}),
        }
