"""Structured output with llguidance: grammars compiled once per (tokenizer, spec), one matcher per
sequence, and each step a packed token bitmask that the jitted sampler applies to the logits.

llguidance (the Rust engine behind vLLM's and llama.cpp's guidance backends) computes a mask over
the vocabulary in tens of microseconds, needs no deep-learning framework (it writes int32 bitmask
words into a numpy array), and takes JSON schemas, regexes, Lark and GBNF grammars.

A sequence's matcher follows its tokens lazily: before each step it consumes the output tokens it
has not seen, so forks (``n > 1``), recompute preemption and prefix-cache hits need nothing more
than ``Sequence.fork`` copying the matcher.

A grammar that llguidance accepts may still fail once decoding starts (a parser row or the lexer
over its limits, a schema no output can satisfy): `compile_grammar` computes the first masks along
one path, so such a grammar is a ValueError before the request runs. One that still fails later
ends its sequence with finish_reason "error" (`StructuredState.error`), never a silent "stop".
"""
import collections
import threading

import numpy as np

_lock = threading.Lock()
_tokenizers: dict = {}                        # (id(hf tokenizer), vocab size) -> (hf tokenizer, LLTokenizer)
_grammars: collections.OrderedDict = collections.OrderedDict()  # (tokenizer key, kind, text) -> Grammar
MAX_CACHED_GRAMMARS = 256
# JSON is written as ``{"a": 1, "b": [2, 3]}``: no free whitespace, which a weak model would fill
# until max_tokens. A schema can override these with an "x-guidance" object (llguidance's options).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_CHOICES = 100_000  # options of one `choice`; 100k compile and walk in about a second
PROBE_TOKENS = 8       # tokens `compile_grammar` walks to find a grammar that fails once decoding starts
REGEX_META = set("\\.+*?()|[]{}^$#&-~")  # what Rust's regex syntax needs escaped


def _ll_tokenizer(tokenizer, vocab_size: int):
    """llguidance's view of a transformers fast tokenizer (HF or the GGUF one), built once (~1 s)."""
    import llguidance.hf

    key = (id(tokenizer), vocab_size)
    entry = _tokenizers.get(key)
    if entry is None or entry[0] is not tokenizer:
        n_vocab = max(vocab_size, len(tokenizer))
        entry = (tokenizer, llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab))
        _tokenizers[key] = entry
    return entry[1]


class Grammar:
    """A compiled grammar: a matcher at the start state, copied for each new sequence."""

    def __init__(self, matcher, n_vocab: int):
        self._template = matcher
        self.n_vocab = n_vocab

    @property
    def bitmask_width(self) -> int:
        return (self.n_vocab + 31) // 32

    def new_state(self) -> "StructuredState":
        return StructuredState(self._template.deep_copy(), self)


class StructuredState:
    """One sequence's position in its grammar (``num_consumed`` output tokens accepted so far)."""

    def __init__(self, matcher, grammar: Grammar, num_consumed: int = 0):
        self.matcher = matcher
        self.grammar = grammar
        self.num_consumed = num_consumed

    def fork(self) -> "StructuredState":
        return StructuredState(self.matcher.deep_copy(), self.grammar, self.num_consumed)

    def sync(self, output_token_ids: list[int]) -> None:
        """Consumes the output tokens the matcher has not seen yet."""
        new = output_token_ids[self.num_consumed:]
        if new and not self.matcher.is_stopped():
            self.matcher.consume_tokens(new)
        self.num_consumed = len(output_token_ids)

    @property
    def active(self) -> bool:
        """False once the grammar has finished or failed; then only EOS is allowed (`fill_bitmask`)."""
        return not (self.matcher.is_stopped() or self.matcher.is_error())

    @property
    def error(self) -> str | None:
        """Why the grammar failed (a limit hit, a token it rejects), or None: the sequence then ends
        with finish_reason "error", not "stop"."""
        return _first_line(self.matcher.get_error()) if self.matcher.is_error() else None

    def fill_bitmask(self, out: np.ndarray, eos_token_ids) -> None:
        """Writes the allowed next tokens into ``out`` (int32 words)."""
        if not self.active:
            out[:] = 0
            words = out.view(np.uint32)
            for t in eos_token_ids:
                words[t // 32] |= np.uint32(1 << (t % 32))
            return
        self.matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.size * out.itemsize)


_executor = None
PARALLEL_MIN_ROWS = 16  # below this a thread pool costs more than it saves (measured on 2 cores)


def fill_bitmasks(states: list[tuple["StructuredState", int]], mask: np.ndarray) -> None:
    """Fills ``mask[i]`` for each active (state, i); on llguidance's thread pool when there are many."""
    global _executor
    if len(states) < PARALLEL_MIN_ROWS:
        for state, i in states:
            state.fill_bitmask(mask[i], ())
        return
    import llguidance

    if _executor is None:
        _executor = llguidance.LLExecutor()
    _executor.unsafe_compute_mask_ptr([(s.matcher, i) for s, i in states], mask.ctypes.data,
                                      mask.shape[1] * 4, mask.shape[0])


def _first_line(error: str) -> str:
    """llguidance's error without the parser state and grammar it appends."""
    line = error.split("\n<state>", 1)[0].split("\n", 1)[0].strip()
    return "no output can satisfy it" if line == "NoExtensionBias" else line or "the grammar failed"


def choice_regex(choices: list[str]) -> str:
    """The options as one regex alternation: a single lexeme, so that llguidance's parser sees one
    item however many options there are (as grammar alternatives, 2,000 overflow a parser row)."""
    return "(" + "|".join(_regex_escape(c) for c in choices) + ")"


def json_after_marker(schema: dict, marker: str, prefix: str | None = None) -> str:
    """A Lark grammar (llguidance's dialect): ``prefix`` if given, any text up to the first ``marker``,
    optional whitespace, then JSON valid against ``schema``. A reasoning model thinks freely and the
    constraint applies to its answer from ``</think>`` on."""
    import json

    end = _regex_escape(marker).replace("/", "\\/")
    start = f"{json.dumps(prefix)} " if prefix else ""
    return (f"start: {start}free_text /[ \\t\\r\\n]*/ answer\n"
            f"free_text[lazy]: /(?s:.*){end}/\n"
            f"answer: %json {json.dumps(schema)}\n")


def _regex_escape(text: str) -> str:
    return "".join("\\" + ch if ch in REGEX_META else ch for ch in text)


def grammar_text(spec) -> str:
    """The llguidance grammar for a StructuredOutputsParams; ValueError if it does not parse."""
    import llguidance

    kind, text = spec.key()
    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
        if kind == "choice":
            if len(spec.choice) > MAX_CHOICES:
                raise ValueError(f"{len(spec.choice)} options; at most {MAX_CHOICES} are supported")
            return llguidance.LLMatcher.grammar_from_regex(choice_regex(spec.choice))
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(text)
        return llguidance.grammar_from("grammar", text)
    except (ValueError, RuntimeError) as e:
        raise ValueError(f"structured_outputs.{kind}: {e}") from None


def compile_grammar(spec, tokenizer, vocab_size: int) -> Grammar:
    """The compiled grammar for ``spec`` (a StructuredOutputsParams), cached per tokenizer and spec."""
    import llguidance

    kind, text = spec.key()
    with _lock:
        ll_tok = _ll_tokenizer(tokenizer, vocab_size)
        key = (id(ll_tok), kind, text)
        grammar = _grammars.get(key)
        if grammar is not None:
            _grammars.move_to_end(key)
            return grammar
    source = grammar_text(spec)
    error = llguidance.LLMatcher.validate_grammar(source, ll_tok)
    if error and not error.startswith("WARNING"):
        raise ValueError(f"structured_outputs.{kind}: {error}")
    matcher = llguidance.LLMatcher(ll_tok, source, log_level=0)
    if matcher.is_error():
        raise ValueError(f"structured_outputs.{kind}: {_first_line(matcher.get_error())}")
    grammar = Grammar(matcher, ll_tok.vocab_size)
    error = probe(grammar, tokenizer)
    if error:
        raise ValueError(f"structured_outputs.{kind}: not usable within the grammar engine's limits ({error})")
    with _lock:
        _grammars[key] = grammar
        while len(_grammars) > MAX_CACHED_GRAMMARS:
            _grammars.popitem(last=False)
    return grammar


def probe(grammar: Grammar, tokenizer) -> str | None:
    """Why ``grammar`` fails in its first `PROBE_TOKENS` steps (each time taking the lowest allowed
    token that is not EOS), or None. Catches what only shows once decoding starts: a schema that no
    output satisfies, a parser row or a lexer over llguidance's limits."""
    state = grammar.new_state()
    eos = {t for t in (getattr(tokenizer, "eos_token_id", None),) if t is not None}
    mask = np.zeros(grammar.bitmask_width, np.int32)
    for _ in range(PROBE_TOKENS):
        state.fill_bitmask(mask, ())
        if state.error:
            return state.error
        if not state.active:
            return None
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:grammar.n_vocab]
        allowed = [t for t in np.flatnonzero(bits).tolist() if t not in eos]
        if not allowed:
            return None if state.matcher.is_accepting() else "no token is allowed"
        state.matcher.consume_token(allowed[0])
    return state.error
