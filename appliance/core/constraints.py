"""Constrained decoding: the token mask that keeps a stream inside a grammar.

OpenAI's ``response_format`` (``json_schema``, ``json_object``) and forced tool calls
(``tool_choice`` ``required`` or a named function) are grammars over *text*; this module
turns one into a mask over the version's own vocabulary at every decode step, with
llguidance (Microsoft's grammar engine, also behind llama.cpp's and vLLM's guided
decoding; bench/RESULTS.md says why it was chosen over outlines-core and xgrammar).

* ``TokenTable.of(tokenizer)``: the version's tokenizer as llguidance sees it: a
  ``tokenizer.json`` read by llguidance itself, else token bytes (the special tokens, EOS
  among them, marked so that no grammar text can use them). Built once per version. A
  vocabulary without an EOS token gets a virtual one past its end: the model cannot pick
  it, so such a stream ends when the grammar can take nothing more.
* ``Grammar``: a compiled, validated grammar (``json_schema``, ``json_object``, ``lark``);
  a grammar the engine refuses raises ``InvalidArgument`` naming why, before any stream.
* ``Constraint``: one stream's matcher: ``allowed()`` -> a boolean mask over the model's
  logits, ``advance(token)``, ``finished`` once the grammar is complete.

Thread-safety: a ``Grammar`` is immutable and shared, a ``TokenTable`` too (its cache of
compiled matchers is locked); a
``Constraint`` belongs to one stream and is used by its decode loop only. llguidance is
imported on first use: a device that never constrains never loads it.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

import numpy as np

from appliance.core.errors import InvalidArgument
from appliance.core.json_types import JSONObject, ReadJSONObject

if TYPE_CHECKING:  # llguidance is imported on first use (module docstring)
    from llguidance import LLMatcher, LLTokenizer

SPECIAL = b"\xff"  # llguidance's mark of a special token: never part of grammar text
# Compact JSON (no whitespace between tokens): a small model cannot loop on spaces forever,
# and the text is what json.dumps(..., separators=(",", ":")) writes.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
# JSON text of any object: what response_format json_object asks for
ANY_OBJECT: JSONObject = {"type": "object"}
MATCHERS_KEPT = 32  # compiled grammars kept per vocabulary (TokenTable.matcher)


def llguidance_module() -> ModuleType:
    """llguidance, or ``InvalidArgument`` saying how to install it (call before importing from it)."""
    try:
        import llguidance
    except ImportError as exc:  # a lean install without the grammar engine
        raise InvalidArgument("constrained decoding (response_format, forced tool calls) needs the llguidance "
                              "package on this device (pip install llguidance)") from exc
    return llguidance


def tokenizer_of_bytes(tokens: Sequence[bytes], eos: int | None, special: frozenset[int],
                       encode: Callable[[str], list[int]] | None = None) -> LLTokenizer:
    """An llguidance tokenizer over token bytes (a vocabulary no library reads for it): the
    special tokens, EOS among them, marked so that no grammar text can use them; without an
    EOS, a virtual one past the end. ``encode``: the version's own encoder (else greedy
    longest match over the bytes, as appliance/core/text.py's Vocabulary encodes)."""
    llguidance_module()
    from llguidance import LLTokenizer, TokenizerWrapper

    raw = [(SPECIAL + t) if i in special or i == eos else t for i, t in enumerate(tokens)]
    if eos is None:
        eos = len(raw)
        raw.append(SPECIAL + b"<eos>")
    return LLTokenizer(TokenizerWrapper(_Wrapper(raw, eos, encode)))


class Vocab(Protocol):
    """What ``TokenTable.of`` reads of a version's tokenizer (appliance/core/tokenizer.py's classes)."""

    size: int

    def grammar_tokenizer(self) -> LLTokenizer: ...


class TokenTable:
    """A vocabulary as the grammar engine reads it (module docstring). Immutable."""

    def __init__(self, tokenizer: LLTokenizer, model_vocab: int):
        self.tokenizer = tokenizer
        self.model_vocab = model_vocab  # the version's tokens (a virtual EOS lies past them)
        self.size = self.tokenizer.vocab_size
        self.words = (self.size + 31) // 32
        self._matchers: OrderedDict[str, LLMatcher] = OrderedDict()  # grammar source -> a fresh matcher, to copy
        self._lock = threading.Lock()

    def matcher(self, grammar: "Grammar") -> LLMatcher:
        """A fresh matcher of ``grammar`` at its start. Building one compiles the grammar
        (~0.2-0.6 ms); a copy of a cached one costs ~0.5 us, so the matchers of the last
        MATCHERS_KEPT grammars (an app sends the same schema every time) are kept."""
        with self._lock:
            proto = self._matchers.get(grammar.source)
            if proto is not None:
                self._matchers.move_to_end(grammar.source)
                return proto.deep_copy()
        llguidance_module()
        from llguidance import LLMatcher

        proto = LLMatcher(self.tokenizer, grammar.source, log_level=0)
        if proto.is_error():
            raise InvalidArgument(f"{grammar.what}: {proto.get_error()}")
        with self._lock:
            self._matchers[grammar.source] = proto
            while len(self._matchers) > MATCHERS_KEPT:
                self._matchers.popitem(last=False)
        return proto.deep_copy()

    def knows(self, source: str) -> bool:
        with self._lock:
            return source in self._matchers

    @classmethod
    def of(cls, vocab: Vocab) -> "TokenTable":
        """The table of a version's tokenizer (appliance/core/tokenizer.py): built from the same
        tokenizer, by llguidance itself where it reads the format."""
        return cls(vocab.grammar_tokenizer(), vocab.size)


class _Wrapper:
    """What llguidance's ``TokenizerWrapper`` reads of a tokenizer."""

    bos_token_id = None

    def __init__(self, tokens: list[bytes], eos: int, encode: Callable[[str], list[int]] | None):
        self.tokens, self.eos_token_id, self._encode = tokens, eos, encode
        self.special_token_ids = [i for i, t in enumerate(tokens) if t.startswith(SPECIAL)]
        lookup = {t: i for i, t in reversed(list(enumerate(tokens))) if t and not t.startswith(SPECIAL)}
        self._lookup, self._longest = lookup, max((len(t) for t in lookup), default=1)

    def __call__(self, text: bytes | str) -> list[int]:
        if self._encode is not None:
            return self._encode(text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text)
        data = text.encode("utf-8") if isinstance(text, str) else text
        ids, i = [], 0
        while i < len(data):
            for size in range(min(self._longest, len(data) - i), 0, -1):
                token = self._lookup.get(data[i:i + size])
                if token is not None:
                    ids.append(token)
                    i += size
                    break
            else:
                i += 1  # a byte no token holds: skipped (the grammar's text never needs it)
        return ids


@dataclass(frozen=True)
class Grammar:
    """A grammar the engine took (``source``: llguidance's serialized grammar)."""

    source: str
    what: str  # for messages: "response_format json_schema", "tool_choice", ...

    @classmethod
    def json_schema(cls, schema: ReadJSONObject, what: str) -> "Grammar":
        llg = llguidance_module()
        try:
            source = llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
        except ValueError as exc:
            raise InvalidArgument(f"{what}: the schema is not a JSON object: {exc}") from exc
        return cls(source, what)

    @classmethod
    def lark(cls, text: str, what: str) -> "Grammar":
        return cls(llguidance_module().LLMatcher.grammar_from_lark(text), what)

    def check(self, table: TokenTable) -> "Grammar":
        """This grammar, or ``InvalidArgument`` with the engine's reason."""
        if table.knows(self.source):  # a matcher was built from it: it was valid
            return self
        llg = llguidance_module()
        error = llg.LLMatcher.validate_grammar(self.source, table.tokenizer)
        if error and not error.startswith("WARNING"):
            raise InvalidArgument(f"{self.what}: the grammar engine cannot take it: {error.strip()}")
        return self


class Constraint:
    """One stream's matcher (module docstring). Used by one decode loop only."""

    def __init__(self, grammar: Grammar, table: TokenTable):
        self.table = table
        self.matcher = table.matcher(grammar)
        self._bits = np.full(table.words, -1, np.int32)

    @property
    def finished(self) -> bool:
        """The grammar is complete and takes nothing more (the stream ends: ``stop``)."""
        return bool(self.matcher.is_stopped())

    def allowed(self) -> np.ndarray:
        """A boolean mask over the model's own vocabulary: the tokens the grammar allows now.
        All False: only the (virtual) end of text is allowed."""
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:self.table.model_vocab]
        return bits.astype(bool)  # the model's logits may run past it: sampling pads the mask  # a real EOS keeps the grammar's bit: the model may end the text there

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise InvalidArgument(f"the grammar refused token {token}: {self.matcher.get_error()}")

    def stop_allowed(self) -> bool:
        """Whether the text may end here (an accepting state)."""
        return bool(self.matcher.is_accepting())


__all__ = ["ANY_OBJECT", "Constraint", "Grammar", "TokenTable", "llguidance_module", "tokenizer_of_bytes"]
