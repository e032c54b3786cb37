"""LLM: the offline API. Batch generation over an LLMEngine, with a progress bar.

An `LLM` may be called from several threads: calls run one at a time (a lock), each over its own
requests. A call that fails or is interrupted aborts its requests, so no blocks are left behind.
"""
import threading
import time

from tqdm.auto import tqdm

from jpaged.engine import create_engine
from jpaged.config_resolution import engine_config
from jpaged.engine.llm_engine import LLMEngine
from jpaged.outputs import BeamSearchOutput, BeamSequence, RequestOutput
from jpaged.sampling_params import BeamSearchParams, SamplingParams


class LLM:
    """Offline batch generation. ``LLM()`` serves the embedded SmolLM2-135M-Instruct."""

    def __init__(self, model: str | None = None, **kwargs):
        self.llm_engine = create_engine(engine_config(model, **kwargs))
        self._next_id = 0
        self._lock = threading.Lock()

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        llm = cls.__new__(cls)
        llm.llm_engine, llm._next_id, llm._lock = engine, 0, threading.Lock()
        return llm

    @classmethod
    def from_model(cls, model, tokenizer=None, **kwargs) -> "LLM":
        """Serves an NNX model already in memory (its parameter arrays as they are, not copied).

        ``model`` has the jpaged model interface (``.config`` a ModelConfig, ``__call__(input_ids,
        positions, kv_caches, md)``, ``compute_logits``), e.g. a `jpaged.models` class or a custom
        one built on `jpaged.models.attention.PagedAttention`. ``tokenizer``: a transformers or
        `tokenizers` tokenizer, or None (then prompts are token ids). ``kwargs``: the engine
        settings of ``LLM(...)``; ``dtype`` (the KV cache's) defaults to the model's parameter
        dtype. The attention backend is the one the model was built with.
        """
        import jax
        from flax import nnx

        from jpaged.loading.orbax_checkpoint import as_hf_tokenizer
        from jpaged.models import ModelConfig

        if not isinstance(getattr(model, "config", None), ModelConfig) or not hasattr(model, "compute_logits"):
            raise ValueError(f"model: {type(model).__name__} lacks the jpaged model interface "
                             "(a ModelConfig `.config` and `compute_logits`)")
        if "dtype" not in kwargs:
            floats = [x.dtype.name for x in jax.tree.leaves(nnx.state(model, nnx.Param))
                      if x.dtype.name in ("float32", "bfloat16", "float16")]
            kwargs["dtype"] = floats[0] if floats else "auto"
        engine = LLMEngine(engine_config(None, **kwargs), model=model, tokenizer=as_hf_tokenizer(tokenizer))
        return cls.from_engine(engine)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_metrics(self) -> dict:
        return self.llm_engine.get_metrics()

    def _prompt_list(self, prompts) -> list:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
            return [list(prompts)]
        return list(prompts)

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True, lora_request=None) -> list[RequestOutput]:
        """Generates for every prompt; outputs in prompt order.

        Every prompt is validated before any is queued: a bad one raises ValueError and nothing runs.
        ``lora_request``: one `LoRARequest` for every prompt, or one (or None) per prompt.
        """
        prompts = self._prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, (list, tuple)):
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        else:
            raise ValueError(f"sampling_params: expected SamplingParams or a list of them, "
                             f"got {type(sampling_params).__name__}")
        return self._generate(prompts, params, use_tqdm, lora_request)

    def chat(self, messages, sampling_params=None, *, chat_template: str | None = None,
             add_generation_prompt: bool = True, use_tqdm: bool = True, tools: list[dict] | None = None,
             tool_choice=None, parallel_tool_calls: bool | None = None, tool_call_parser: str = "hermes",
             reasoning_parser: str | None = None, lora_request=None) -> list[RequestOutput]:
        """Generates replies to one conversation (a list of ``{"role", "content"}`` dicts) or to a
        list of them, each rendered with ``chat_template`` or the tokenizer's own (GGUF metadata or
        ``tokenizer_config.json``); ValueError when there is none. One output per conversation.

        ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` are OpenAI's: the tools reach the
        template; ``"required"`` or a named function decode under a grammar that admits only valid
        calls; ``"auto"`` parses the model's own format with ``tool_call_parser`` (hermes,
        llama3_json, mistral, pythonic). ``reasoning_parser`` (deepseek_r1, qwen3) splits off the
        ``<think>`` part. Each output then has ``content``, ``reasoning_content``, ``tool_calls``
        (OpenAI's shape, or None) and ``finish_reason="tool_calls"`` when it called tools."""
        from jpaged.agents.chat_output import parse_chat_output
        from jpaged.agents.reasoning_parsers import get_reasoning_parser
        from jpaged.agents.tool_parsers import get_tool_parser
        from jpaged.agents.tools import constrained_params, parse_tool_request
        from jpaged.engine.chat_template import apply_chat_template, is_conversation

        conversations = [messages] if is_conversation(messages) else list(messages)
        if not conversations:
            raise ValueError("messages: expected a conversation or a non-empty list of conversations")
        tool_request = parse_tool_request(tools, tool_choice, parallel_tool_calls)
        tool_parser = get_tool_parser(tool_call_parser) if tool_request is not None else None
        reasoning = get_reasoning_parser(reasoning_parser) if reasoning_parser is not None else None
        prompts = []
        for i, conversation in enumerate(conversations):
            try:
                prompts.append(apply_chat_template(self.get_tokenizer(), conversation, chat_template,
                                                   add_generation_prompt,
                                                   self.llm_engine.input_processor.check_text_length,
                                                   tools=tool_request.template_tools if tool_request else None))
            except ValueError as e:
                raise ValueError(f"messages[{i}]: {e}" if len(conversations) > 1 else str(e)) from None
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        engine = self.llm_engine
        sampling_params = [constrained_params(p, tool_request, reasoning, self.get_tokenizer(),
                                              engine.model_config.vocab_size)
                           if isinstance(p, SamplingParams) else p for p in sampling_params]
        outputs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)
        for out in outputs:
            for c in out.outputs:
                message = parse_chat_output(c.text, c.finish_reason, reasoning, tool_parser, tool_request)
                c.content, c.reasoning_content, c.finish_reason = message.content, message.reasoning_content, \
                    message.finish_reason
                c.tool_calls = [t.to_openai() for t in message.tool_calls] or None
        return outputs

    def beam_search(self, prompts, params: BeamSearchParams, use_tqdm: bool = False,
                    lora_request=None) -> list[BeamSearchOutput]:
        """Beam search for each prompt inside the engine (beams share blocks); beams best first."""
        prompts = self._prompt_list(prompts)
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params: expected BeamSearchParams, got {type(params).__name__}")
        outputs = self._generate(prompts, [params] * len(prompts), use_tqdm, lora_request)
        return [BeamSearchOutput(o.prompt_token_ids,
                                 [BeamSequence(c.token_ids, c.text, c.cumulative_logprob, c.score) for c in o.outputs])
                for o in outputs]

    # Training loops ---------------------------------------------------------------------------------
    def update_weights(self, weights, draft_weights=None) -> None:
        """Serves new weights without compiling (`LLMEngine.update_weights`): an ``nnx.State`` of the
        engine's model, ``{hf_parameter_name: array}``, or a path (HF directory, safetensors file,
        orbax checkpoint). ``draft_weights``: the speculative draft model's, in the same forms (without
        it the draft keeps its own). A ValueError on a mismatch, and the old weights keep serving."""
        with self._lock:
            self.llm_engine.update_weights(weights, draft_weights=draft_weights)

    def update_lora(self, lora_request, tensors: dict, config: dict) -> None:
        """Serves (first call) or replaces (later calls, same request) a LoRA adapter given in
        memory: ``tensors`` ``{PEFT tensor name: array}``, ``config`` the fields of PEFT's
        ``adapter_config.json`` (`LLMEngine.update_lora`). Its device slot is rewritten in place and
        nothing compiles; the prefix cache never serves blocks of its old factors."""
        with self._lock:
            self.llm_engine.update_lora(lora_request, tensors, config)

    def sleep(self, level: int = 1) -> None:
        """Frees the KV pool and moves the weights to host memory (level 2: drops them)."""
        with self._lock:
            self.llm_engine.sleep(level)

    def wake_up(self) -> None:
        """Restores the weights and an empty KV pool of the same size (nothing compiles)."""
        with self._lock:
            self.llm_engine.wake_up()

    def score(self, prompt_token_ids, completion_token_ids, use_tqdm: bool = False, lora_request=None):
        """The log-probability of each completion token given the prompt and the completion tokens
        before it, under the current weights (the model's raw distribution): a list of floats, or
        one per pair when both arguments are lists of token lists. One prefill per pair, batched;
        the prefix cache is not read. ``lora_request``: the adapter to score under (one for every
        pair, or one (or None) per pair)."""
        single = bool(prompt_token_ids) and all(isinstance(t, int) for t in prompt_token_ids)
        prompts, completions = ([prompt_token_ids], [completion_token_ids]) if single else (
            list(prompt_token_ids), list(completion_token_ids))
        if len(prompts) != len(completions):
            raise ValueError(f"completion_token_ids: {len(completions)} given for {len(prompts)} prompts")
        for i, (p, c) in enumerate(zip(prompts, completions)):
            for name, ids in (("prompt_token_ids", p), ("completion_token_ids", c)):
                if not isinstance(ids, (list, tuple)) or not ids or not all(isinstance(t, int) for t in ids):
                    raise ValueError(f"{name}[{i}]: expected a non-empty list of token ids")
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, ignore_eos=True)
        outputs = self._generate([list(p) + list(c) for p, c in zip(prompts, completions)],
                                 [params] * len(prompts), use_tqdm, lora_request)
        scores = [[next(iter(entry.values())) for entry in out.prompt_logprobs[len(p):]]
                  for out, p in zip(outputs, prompts)]
        return scores[0] if single else scores

    @staticmethod
    def _lora_list(lora_request, num_prompts: int) -> list:
        """One `LoRARequest` (or None) per prompt."""
        if isinstance(lora_request, (list, tuple)):
            if len(lora_request) != num_prompts:
                raise ValueError(f"lora_request: {len(lora_request)} given for {num_prompts} prompts")
            return list(lora_request)
        return [lora_request] * num_prompts

    def _generate(self, prompts, params, use_tqdm: bool, lora_request=None) -> list[RequestOutput]:
        loras = self._lora_list(lora_request, len(prompts))
        with self._lock:
            ids = self._add_all(prompts, params, loras)
            try:
                return self._run(ids, use_tqdm)
            finally:  # on an exception or an interrupt: nothing of this call stays queued
                for request_id in ids:
                    self.llm_engine.abort_request(request_id)

    def _add_all(self, prompts, params, loras) -> list[str]:
        """Processes every prompt first (a bad one raises and nothing is queued), then queues them."""
        engine = self.llm_engine
        requests = []
        for i, (prompt, p, lora) in enumerate(zip(prompts, params, loras)):
            try:
                requests.append(engine.process(str(self._next_id + i), prompt, p, lora_request=lora))
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from None
        self._next_id += len(requests)
        for request in requests:
            engine.add_request(request)
        return [r.request_id for r in requests]

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm or len(ids) < 2)
        start, num_generated, seen = time.perf_counter(), 0, {}
        last_refresh, idle_steps = start, 0
        while len(done) < len(ids):
            if not engine.has_unfinished_requests():
                raise RuntimeError("engine stopped with requests unfinished")
            outputs = engine.step()
            idle_steps = 0 if outputs else idle_steps + 1
            if idle_steps > 100:  # a scheduler bug, never a user's: fail loudly rather than spin
                raise RuntimeError("the engine made no progress in 100 steps")
            for out in outputs:
                if out.request_id not in wanted:
                    continue
                count = sum(len(c.token_ids) for c in out.outputs)
                num_generated += count - seen.get(out.request_id, 0)
                seen[out.request_id] = count
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
            now = time.perf_counter()
            if now - last_refresh > 0.5:
                bar.set_postfix_str(f"{num_generated} tokens, {num_generated / (now - start):.1f} tok/s")
                last_refresh = now
        bar.close()
        return [done[i] for i in ids]
