"""LLM: the offline API. Batch generation over an LLMEngine, with a progress bar."""
from tqdm.auto import tqdm

from jpaged import presets
from jpaged.config import CacheConfig, EngineConfig, SchedulerConfig
from jpaged.engine import LLMEngine
from jpaged.outputs import BeamSearchOutput, BeamSequence, RequestOutput
from jpaged.sampling_params import BeamSearchParams, SamplingParams

_CACHE_KEYS = {"block_size", "num_kv_blocks", "kv_cache_memory_bytes", "memory_utilization",
               "enable_prefix_caching", "preemption_mode", "swap_space_bytes", "allocator",
               "share_forked_blocks"}
_SCHEDULER_KEYS = {"max_num_seqs", "max_num_batched_tokens", "max_model_len"}
_ENGINE_KEYS = {"dtype", "tensor_parallel_size", "data_parallel_size", "attention_backend", "seed", "compilation_cache_dir"}


def engine_config(model: str | None = None, **kwargs) -> EngineConfig:
    """Builds a validated EngineConfig from LLM-style keyword arguments (presets resolved)."""
    model, kwargs = presets.resolve(model, kwargs)
    unknown = set(kwargs) - _CACHE_KEYS - _SCHEDULER_KEYS - _ENGINE_KEYS
    if unknown:
        raise ValueError(f"unknown engine argument(s): {sorted(unknown)}")
    pick = lambda keys: {k: v for k, v in kwargs.items() if k in keys}  # noqa: E731
    return EngineConfig(model=model, cache=CacheConfig(**pick(_CACHE_KEYS)),
                        scheduler=SchedulerConfig(**pick(_SCHEDULER_KEYS)), **pick(_ENGINE_KEYS))


class LLM:
    """Offline batch generation. ``LLM()`` serves the embedded SmolLM2-135M-Instruct."""

    def __init__(self, model: str | None = None, **kwargs):
        config = engine_config(model, **kwargs)
        if config.data_parallel_size > 1:
            from jpaged.data_parallel import DataParallelEngine
            self.llm_engine = DataParallelEngine(config, config.data_parallel_size)
        else:
            self.llm_engine = LLMEngine(config)
        self._next_id = 0

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        llm = cls.__new__(cls)
        llm.llm_engine, llm._next_id = engine, 0
        return llm

    @classmethod
    def from_model(cls, model, tokenizer=None, **kwargs) -> "LLM":
        """Serves an NNX model already in memory (its parameter arrays as they are, not copied).

        ``model`` has the jpaged model interface (``.config`` a ModelConfig, ``__call__(input_ids,
        positions, kv_caches, md)``, ``compute_logits``), e.g. a `jpaged.models` class or a custom
        one built on `jpaged.attention.PagedAttention`. ``tokenizer``: a transformers or
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

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Generates for every prompt; outputs in prompt order.

        Every prompt is validated before any is queued: a bad one raises ValueError and nothing runs.
        """
        prompts = self._prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        return self._run(self._add_all(prompts, params), use_tqdm)

    def chat(self, messages, sampling_params=None, *, chat_template: str | None = None,
             add_generation_prompt: bool = True, use_tqdm: bool = True) -> list[RequestOutput]:
        """Generates replies to one conversation (a list of ``{"role", "content"}`` dicts) or to a
        list of them, each rendered with ``chat_template`` or the tokenizer's own (GGUF metadata or
        ``tokenizer_config.json``); ValueError when there is none. One output per conversation."""
        from jpaged.chat import apply_chat_template, is_conversation

        conversations = [messages] if is_conversation(messages) else list(messages)
        if not conversations:
            raise ValueError("messages: expected a conversation or a non-empty list of conversations")
        prompts = []
        for i, conversation in enumerate(conversations):
            try:
                prompts.append(apply_chat_template(self.get_tokenizer(), conversation, chat_template,
                                                   add_generation_prompt))
            except ValueError as e:
                raise ValueError(f"messages[{i}]: {e}" if len(conversations) > 1 else str(e)) from None
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(self, prompts, params: BeamSearchParams, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search for each prompt inside the engine (beams share blocks); beams best first."""
        prompts = self._prompt_list(prompts)
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params: expected BeamSearchParams, got {type(params).__name__}")
        outputs = self._run(self._add_all(prompts, [params] * len(prompts)), use_tqdm)
        return [BeamSearchOutput(o.prompt_token_ids,
                                 [BeamSequence(c.token_ids, c.text, c.cumulative_logprob, c.score) for c in o.outputs])
                for o in outputs]

    def _add_all(self, prompts, params) -> list[str]:
        """Tokenizes and validates every prompt first (a bad one raises and nothing is queued), then queues."""
        engine = self.llm_engine
        tokenized = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                text, token_ids = engine.tokenize(prompt)
                engine.validate(token_ids, p)
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from None
            tokenized.append({"prompt": text, "prompt_token_ids": token_ids})
        ids = []
        for prompt, p in zip(tokenized, params):
            ids.append(str(self._next_id))
            engine.add_request(ids[-1], prompt, p)
            self._next_id += 1
        return ids

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", disable=not use_tqdm or len(ids) < 2)
        while len(done) < len(ids):
            if not engine.has_unfinished_requests():
                raise RuntimeError("engine stopped with requests unfinished")
            for out in engine.step():
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[i] for i in ids]
