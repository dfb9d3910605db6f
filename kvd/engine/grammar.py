"""Structured output: grammars compiled by llguidance into matchers, whose token masks constrain sampling."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import llguidance
import llguidance.hf
import torch
from transformers import PreTrainedTokenizerBase

from kvd.request.harmony import answer_grammar
from kvd.request.json_schema import closed_schema
from kvd.request.sampling_params import SamplingParams

# JSON in one canonical, terminating shape: `{"a": 1, "b": [2, 3]}`. Flexible whitespace would let a model pad
# with newlines until max_tokens; these separators are the ones models write most.
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
MAX_GRAMMAR_CHARS = 1 << 20
CACHE_SIZE = 256
LIBRARY = f"llguidance {llguidance.__version__}"


class GrammarError(ValueError):
    """A structured-output field the library refuses; `field` names it, the message has the library's reason."""

    def __init__(self, field_name: str, reason: str) -> None:
        super().__init__(f"{field_name}: {reason}")
        self.field = field_name
        self.reason = reason


class GrammarCompiler:
    """Compiles each request's structured-output field once (cached by its text) and hands out fresh matchers.

    Thread-safe: the daemon compiles on its prompt worker, so that a slow grammar never stalls the engine loop,
    and the engine takes the cached result at admission.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: set[int]) -> None:
        self._hf_tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids) or None
        self._tokenizer: llguidance.LLTokenizer | None = None  # built on first use (~1 s)
        self._cache: OrderedDict[tuple[str, str, str], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0

    def matcher(
        self, params: SamplingParams, namespace: str = "", harmony: bool = False
    ) -> llguidance.LLMatcher | None:
        """A matcher at the start of the request's grammar, or None without one; raises GrammarError.

        `namespace` keys the cache (the daemon's tenant): a cached grammar answers measurably faster than a
        compile, which would tell one tenant which schemas another used recently. `harmony`: a harmony chat's,
        where a JSON answer is the final message's, after any analysis."""
        structured = params.structured
        if structured is None:
            return None
        name, value = structured
        harmony = harmony and name in ("json_schema", "json_object")
        key = (namespace, name + " in harmony" * harmony, _text(name, value))
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                return template.deep_copy()
            tokenizer = self._llg_tokenizer()
        template = self._compile(name, key[2], tokenizer, harmony)  # outside the lock: may take a while
        with self._lock:
            self._cache[key] = template
            self.num_compiled += 1
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return template.deep_copy()

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = llguidance.hf.from_tokenizer(
                self._hf_tokenizer, n_vocab=self._vocab_size, eos_token=self._eos
            )
        return self._tokenizer

    def _compile(
        self, name: str, text: str, tokenizer: llguidance.LLTokenizer, harmony: bool
    ) -> llguidance.LLMatcher:
        if len(text) > MAX_GRAMMAR_CHARS:
            raise GrammarError(name, f"is {len(text)} characters long; at most {MAX_GRAMMAR_CHARS}")
        try:
            grammar = _grammar(name, text, harmony)
        except ValueError as e:
            raise GrammarError(name, str(e)) from None
        # llguidance's default limits bound a grammar's size and each mask step's work (a hostile schema fails).
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(name, matcher.get_error().strip())
        return matcher


def _text(name: str, value: object) -> str:
    """The field's value as the text the cache is keyed by (key order kept: it is the output's order)."""
    if name == "json_schema" and isinstance(value, dict):
        return json.dumps(value, separators=(",", ":"))
    if name == "json_object":
        return ""
    return str(value)


def _grammar(name: str, text: str, harmony: bool = False) -> str:
    if name in ("json_schema", "json_object"):
        schema = _schema(text) if name == "json_schema" else {"type": "object"}
        if harmony:  # the final message's content
            schema = schema if isinstance(schema, dict) else {} if schema else {"not": {}}
            return answer_grammar("%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS}))
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if name == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    return llguidance.LLMatcher.grammar_from_lark(text)


def _schema(text: str) -> dict | bool:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON: {e}") from None
    if not isinstance(schema, dict | bool):
        raise ValueError("a JSON schema is an object (or true/false)")
    return closed_schema(schema)


def apply_masks(logits: torch.Tensor, rows: list[int], matchers: list[llguidance.LLMatcher]) -> torch.Tensor:
    """Set to -inf, in place in rows `rows` of `logits`, every token the row's matcher does not allow next."""
    vocab = logits.shape[1]
    words = (vocab + 31) // 32
    bitmask = torch.empty((len(rows), words), dtype=torch.int32)
    for i, matcher in enumerate(matchers):
        matcher.unsafe_compute_mask_ptr(bitmask[i].data_ptr(), words * 4)
    # Byte by byte through a table (bit j of byte b is token 8b + j, little-endian): a gather, not 32 shifts.
    allowed = _BYTE_BITS[bitmask.view(torch.uint8).long()].reshape(len(rows), words * 32)[:, :vocab]
    allowed = allowed.to(logits.device)
    if len(rows) == logits.shape[0]:
        return logits.masked_fill_(~allowed, float("-inf"))
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill_(~allowed, float("-inf"))
    return logits


_BYTE_BITS = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool()  # [256, 8]
