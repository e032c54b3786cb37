"""Input processing: a prompt in any accepted form + its parameters -> a validated `Request`.

Every check on a request runs here, once, before it reaches the scheduler or the device: a bad one
raises ``ValueError`` naming the field and nothing else changes. It reads only settings fixed at
start-up (the tokenizer, the model's vocabulary, the pool size), so it may run on any thread.
"""
import functools
import os
from dataclasses import dataclass

import numpy as np

from jpaged.config import SchedulerConfig
from jpaged.core.kv_cache_layout import KVCacheLayout, kv_cache_layout
from jpaged.core.request import Request
from jpaged.sample import beam_search
from jpaged.sample.structured_output import compile_grammar
from jpaged.sampling_params import BeamSearchParams, SamplingParams, bad_word_token_ids
from jpaged.utils import check_text

_PROCESS_NONCE = os.urandom(8).hex()  # in LoRA requests' cache salt (disk-tier entries are per process)


@dataclass
class InputProcessor:
    tokenizer: object
    vocab_size: int
    max_model_len: int
    num_blocks: int
    block_size: int
    scheduler_config: SchedulerConfig
    eos_token_ids: tuple[int, ...] = ()
    speculative_config: object = None  # a SpeculativeConfig: beam search is refused with it

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token stands for (its vocabulary string's length bounds it)."""
        return max(map(len, self.tokenizer.get_vocab()), default=1) if self.tokenizer is not None else 1

    @property
    def max_prompt_chars(self) -> int:
        """The longest text that can be a prompt: ``max_model_len`` tokens of the longest kind. Longer
        text is refused before tokenizing it (megabytes of it would take seconds of CPU)."""
        return self.max_model_len * self.max_token_chars

    def check_text_length(self, text: str, field: str = "prompt") -> None:
        if len(text) > self.max_prompt_chars:
            raise ValueError(f"{field}: {len(text)} characters, more than max_model_len={self.max_model_len} "
                             f"tokens can hold (a token of this vocabulary is at most {self.max_token_chars} "
                             "characters)")
    kv_layout: KVCacheLayout | None = None  # the KV-cache groups (None: one group of global layers)
    kv_bytes_per_block: int = 0  # a block's bytes per device (0: unknown), to say how far to raise the pool
    max_model_len_note: str = ""  # why max_model_len is below the model's (start-up capped it), or ""

    @property
    def layout(self) -> KVCacheLayout:
        return self.kv_layout or kv_cache_layout([None])

    def blocks_per_seq(self, num_tokens: int) -> int:
        """The blocks one sequence of ``num_tokens`` tokens holds at most (windowed groups: their
        windows' blocks)."""
        return self.layout.max_blocks_per_seq(num_tokens, self.block_size, self.scheduler_config.max_num_batched_tokens)

    def check_pool_room(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """ValueError, naming what to change and by how much, when the request's sequences at their
        longest (``max_tokens=None``: up to max_model_len) need more blocks than the pool has."""
        n, max_tokens = params.n, params.max_tokens
        max_len = min(self.max_model_len, num_prompt_tokens + (max_tokens or self.max_model_len))
        need = n * self.blocks_per_seq(max_len)
        if need <= self.num_blocks:
            return
        fits = self.layout.max_tokens_per_seq(self.num_blocks // n, self.block_size,
                                              self.scheduler_config.max_num_batched_tokens, self.max_model_len)
        missing = need - self.num_blocks
        pool = f"num_kv_blocks >= {need}" + (f" (kv_cache_memory_bytes >= {need * self.kv_bytes_per_block})"
                                             if self.kv_bytes_per_block else "")
        asked = f"max_tokens={max_tokens}" if max_tokens is not None else \
            f"max_tokens=None (up to max_model_len={self.max_model_len})"
        what = (f"{asked}: this request's {n} sequence(s) of up to {max_len} tokens ({num_prompt_tokens} prompt "
                f"tokens) may need {need} KV blocks of {self.block_size} tokens, {missing} more than the pool's "
                f"{self.num_blocks}; ")
        if fits > num_prompt_tokens:
            fix = f"set max_tokens <= {fits - num_prompt_tokens}" + (", lower n" if n > 1 else "")
        else:
            fix = "shorten the prompt" + (" or lower n" if n > 1 else "")
        raise ValueError(what + f"{fix}, or start the engine with {pool}")

    def tokenize(self, prompt) -> tuple[str | None, list[int], str | None]:
        """(text or None, token ids, cache_salt or None) of a prompt in any accepted form."""
        salt = None
        if isinstance(prompt, dict):
            salt = prompt.get("cache_salt")
            if salt is not None and not isinstance(salt, str):
                raise ValueError(f"cache_salt: expected a string, got {type(salt).__name__}")
            check_text(salt, "cache_salt")
            if "prompt_token_ids" in prompt:
                text = prompt.get("prompt")
                if text is not None and not isinstance(text, str):
                    raise ValueError(f"prompt: expected a string beside prompt_token_ids, got {type(text).__name__}")
                check_text(text, "prompt")
                return text, self._token_ids(prompt["prompt_token_ids"]), salt
            if "prompt" not in prompt:
                raise ValueError("prompt: a dict prompt needs 'prompt_token_ids' or 'prompt'")
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: text given but the model has no tokenizer; pass token ids")
            check_text(prompt, "prompt")
            self.check_text_length(prompt)
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
        """The checks on a tokenized request that need no compilation (grammars are compiled by
        `process`)."""
        if not isinstance(params, (SamplingParams, BeamSearchParams)):
            raise ValueError(f"sampling_params: expected SamplingParams or BeamSearchParams, "
                             f"got {type(params).__name__}")
        params.validate()
        if isinstance(params, BeamSearchParams) and self.speculative_config is not None:
            raise ValueError(f"BeamSearchParams: beam search does not run with speculative_config "
                             f"(method={self.speculative_config.method!r}); serve it from an engine without")
        vocab = self.vocab_size
        params.validate_for_vocab(vocab, self.tokenizer)  # ids, logprobs, beam width, a tokenizer
        if isinstance(params, BeamSearchParams):
            params = SamplingParams(n=params.beam_width, max_tokens=params.max_tokens)
        sc = self.scheduler_config
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
            note = f" ({self.max_model_len_note})" if self.max_model_len_note else ""
            raise ValueError(f"prompt: {n} tokens, but max_model_len={self.max_model_len}{note} leaves no room "
                             f"to generate (the prompt must be shorter)")
        self.check_pool_room(n, params)

    def process(self, request_id: str, prompt, params: SamplingParams | BeamSearchParams | None = None, *,
                cache_salt: str | None = None, lora_request=None, lora=None) -> Request:
        """The request, validated, its bad words tokenized and its grammar compiled (cached);
        ``prompt`` may carry its own ``cache_salt`` (``{"prompt_token_ids": ..., "cache_salt": ...}``).
        With `BeamSearchParams` it is a beam search (beams scheduled together). ``lora_request``: a
        `LoRARequest`, checked (its adapter read) by ``lora``, the engine's `LoRAManager`."""
        params = SamplingParams() if params is None else params
        text, token_ids, salt = self.tokenize(prompt)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt: expected a string, got {type(cache_salt).__name__}")
        check_text(cache_salt, "cache_salt")
        self.validate(token_ids, params)
        if lora_request is not None:
            if lora is None:
                raise ValueError("lora_request: this engine serves no adapters (start it with enable_lora=True)")
            lora.check(lora_request)
        grammar, bad_word_ids = None, []
        if isinstance(params, SamplingParams):
            grammar, bad_word_ids = self._compile(params)
        beam = None
        if isinstance(params, BeamSearchParams):
            max_new = min(params.max_tokens, self.max_model_len - len(token_ids))
            beam = beam_search.BeamState(params, max_new)
            params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=params.ignore_eos)
            params.logprobs = 2 * beam.params.beam_width  # each beam's top 2k next tokens
        cache_salt = cache_salt if cache_salt is not None else salt
        if params.prompt_logprobs is not None:  # cached blocks are never run: skip the cache
            cache_salt = f"{cache_salt}/prompt_logprobs/{request_id}"
        if lora_request is not None:  # blocks computed under one adapter (or under its replaced
            # factors) are never another's, nor, on the disk tier, those of another process's adapter
            cache_salt = f"{cache_salt}/lora/{lora.cache_key(lora_request)}/{_PROCESS_NONCE}"
        request = Request(str(request_id), text, token_ids, params, eos_token_ids=self.eos_token_ids,
                          cache_salt=cache_salt, beam=beam, grammar=grammar, bad_word_ids=bad_word_ids,
                          lora_request=lora_request)
        request.seqs[0].max_tokens = min(params.max_tokens or self.max_model_len, self.max_model_len - len(token_ids))
        return request

    def _compile(self, params: SamplingParams):
        """(grammar or None, bad words as token ids) of a validated request."""
        grammar = None
        bad_word_ids = bad_word_token_ids(params.bad_words, self.tokenizer) if params.bad_words else []
        if params.structured_outputs is not None:
            grammar = compile_grammar(params.structured_outputs, self.tokenizer, self.vocab_size)
        return grammar, bad_word_ids
