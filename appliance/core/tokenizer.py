"""A version's tokenizer, read by the libraries made for the formats checkpoints ship.

``load(version_dir)`` looks in ``assets/`` (TF Serving's place for such files), then in the
version directory itself (an exported Hugging Face checkout), for:

* ``tokenizer.json``: Hugging Face ``tokenizers`` (byte-level BPE, Metaspace, WordPiece...:
  what Llama 3, Qwen, SmolLM, Phi, DeepSeek, Gemma's fast tokenizer ship);
* ``tokenizer.model``: ``sentencepiece`` (Gemma, Llama 2, T5...), added tokens split out of the
  text first, as Hugging Face's slow tokenizers do;
* ``vocab.json`` as a JSON *list*: appliance/core/text.py's ``Vocabulary`` (the tiny
  character-level versions of the tests and the sample model).

Special tokens, BOS and EOS come from ``tokenizer_config.json`` and ``generation_config.json``
as Hugging Face reads them: ``eos_token`` / ``bos_token`` (a string or ``{"content": ...}``),
``added_tokens_decoder``, ``add_bos_token``; every id of ``generation_config.eos_token_id`` (an
int or a list) ends a stream too. ``encode(text, special)``: ``special`` adds what the
tokenizer's post-processor adds (BOS): true for a raw completion prompt, false for a chat
prompt, whose template writes its own BOS (vLLM's rule). ``decode_all`` skips special tokens.

``Detokenizer``: text of a growing id list, one piece per token, never a broken character:
vLLM's and TGI's prefix-offset method (decode a short window before the new ids, emit only
what follows the window's own text, and hold back text that ends in U+FFFD: the bytes of a
character split across tokens). Its pieces join to the decode of the whole.

Thread-safety: a tokenizer is read-only after ``load`` and shared (``tokenizers``' Rust
encoder and SentencePiece are thread-safe for encode/decode); a ``Detokenizer`` belongs to
one stream's reader.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Callable, Iterable, Protocol, Sequence

from appliance.core.errors import InvalidArgument
from appliance.core.json_types import JSONObject, ReadJSONObject, ReadJSONValue

if TYPE_CHECKING:  # llguidance is imported when a grammar is first asked for (constraints.py)
    from llguidance import LLTokenizer

VOCAB_FILE = os.path.join("assets", "vocab.json")

HF_FILE, SPM_FILE = "tokenizer.json", "tokenizer.model"
CONFIG_FILE, GENERATION_FILE = "tokenizer_config.json", "generation_config.json"
PLACES = ("assets", "")  # where a version's tokenizer files are looked for, in order
PREFIX_WINDOW = 5  # prompt ids a detokenizer decodes before the first new one (vLLM's offset)
REPLACEMENT = "\ufffd"


class MissingLibrary(InvalidArgument):
    """The library of a version's tokenizer file is not installed on this device."""


class Tokenizer(Protocol):
    """What the APIs and the step scheduler read of a version's tokenizer (every class here,
    and text.py's ``Vocabulary``)."""

    size: int  # ids 0..size-1 (added tokens included)
    eos_id: int | None
    stop_ids: frozenset[int]  # every id that ends a stream
    special_ids: frozenset[int]  # never part of decoded text or of a grammar's text

    def encode(self, text: str, special: bool = True) -> list[int]: ...

    def decode(self, token: int) -> str: ...

    def decode_all(self, ids: Sequence[int]) -> str: ...

    def token_bytes(self, token: int) -> bytes: ...

    def fewest_tokens(self, text: str) -> int: ...

    def grammar_tokenizer(self) -> LLTokenizer: ...


class Decodes(Protocol):
    def decode_all(self, ids: Sequence[int]) -> str: ...


def find(version_dir: str, name: str) -> str | None:
    """The path of a tokenizer file of the version (module docstring: assets/, then the root)."""
    for place in PLACES:
        path = os.path.join(version_dir, place, name)
        if os.path.isfile(path):
            return path
    return None


def read_json(version_dir: str, name: str) -> JSONObject:
    """A JSON object file of the version ({} when it ships none); InvalidArgument when unreadable."""
    path = find(version_dir, name)
    if path is None:
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"{name} of this version is not readable JSON: {exc}") from exc
    return data if isinstance(data, dict) else {}


def token_text(token: ReadJSONValue) -> str:
    """A special token as Hugging Face's configs write it: a string or {"content": ...}."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else ""


def _ids(value: ReadJSONValue) -> list[int]:
    """generation_config's eos_token_id: an int or a list of them."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def added_tokens(config: ReadJSONObject) -> dict[int, tuple[str, bool]]:
    """tokenizer_config's ``added_tokens_decoder``: id -> (content, special)."""
    added = config.get("added_tokens_decoder")
    out: dict[int, tuple[str, bool]] = {}
    if isinstance(added, dict):
        for key, entry in added.items():
            if str(key).isdigit() and isinstance(entry, dict) and isinstance(entry.get("content"), str):
                out[int(key)] = (entry["content"], bool(entry.get("special")))
    return out


class Detokenizer:
    """Incremental detokenization (module docstring): ``feed(id)`` -> the new text (maybe
    empty while a character is incomplete), ``flush()`` -> what is left at the end."""

    def __init__(self, tokenizer: Decodes, prompt: Sequence[int] = ()):
        self.decode = tokenizer.decode_all
        self.ids = list(prompt[-PREFIX_WINDOW:])
        self.prefix = 0  # ids[prefix:read]: the window already shown, decoded for its length only
        self.read = len(self.ids)

    def feed(self, token: int) -> str:
        self.ids.append(token)
        shown = self.decode(self.ids[self.prefix:self.read])
        text = self.decode(self.ids[self.prefix:])
        if len(text) <= len(shown) or text.endswith(REPLACEMENT):
            return ""  # nothing new yet, or a character whose bytes are still coming
        self.prefix, self.read = self.read, len(self.ids)
        if self.prefix > 4 * PREFIX_WINDOW:  # keep the list short: only ids[prefix:] are read again
            del self.ids[:self.prefix]
            self.read, self.prefix = self.read - self.prefix, 0
        return text[len(shown):]

    def text(self, ids: Iterable[int]) -> str:
        """The whole text of ``ids`` as the pieces would join."""
        return "".join(self.feed(t) for t in ids) + self.flush()

    def flush(self) -> str:
        shown = self.decode(self.ids[self.prefix:self.read])
        text = self.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(shown):]


class HFTokenizer:
    """``tokenizer.json`` through Hugging Face ``tokenizers`` (module docstring)."""

    def __init__(self, path: str, config: ReadJSONObject, generation: ReadJSONObject):
        from tokenizers import Tokenizer  # lazily: only a version that ships one loads the library

        try:
            self.tokenizer = Tokenizer.from_file(path)
        except Exception as exc:  # the Rust side raises a bare Exception for a malformed file
            raise InvalidArgument(f"{HF_FILE} of this version cannot be read by tokenizers: {exc}") from exc
        self._add_missing(added_tokens(config))
        self.json = self.tokenizer.to_str()  # after: the grammar engine sees the added tokens too
        added = {i: (t.content, t.special) for i, t in self.tokenizer.get_added_tokens_decoder().items()}
        self.size = max(self.tokenizer.get_vocab_size(with_added_tokens=True), max(added, default=-1) + 1)
        self.special_ids = frozenset(i for i, (_, special) in added.items() if special)
        self.eos_id, self.stop_ids = _stops(config, generation, self.tokenizer.token_to_id)
        self.longest = max((len(t.encode("utf-8")) for t in self.tokenizer.get_vocab()), default=1)
        self._bytes = _byte_decoder(json.loads(self.json).get("decoder"))

    def _add_missing(self, listed: dict[int, tuple[str, bool]]) -> None:
        """tokenizer_config's added tokens that tokenizer.json lacks, added as Hugging Face's
        fast tokenizer adds them when it loads (in id order, so they take the ids listed)."""
        from tokenizers import AddedToken

        for _, (content, special) in sorted(listed.items()):
            if self.tokenizer.token_to_id(content) is None:
                self.tokenizer.add_tokens([AddedToken(content, special=special, normalized=not special)])

    def encode(self, text: str, special: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=special).ids)

    def decode_all(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def token_bytes(self, token: int) -> bytes:
        piece = self.tokenizer.id_to_token(token)
        if piece is None:
            return b""
        if token in self.special_ids:
            return piece.encode("utf-8")
        return self._bytes(piece)

    def decode(self, token: int) -> str:
        """One token's own text (logprobs): its bytes, a split character as U+FFFD."""
        return self.token_bytes(token).decode("utf-8", errors="replace")

    def fewest_tokens(self, text: str) -> int:
        return -(-len(text.encode("utf-8")) // self.longest)

    def grammar_tokenizer(self) -> LLTokenizer:
        """llguidance's view of the same tokenizer: it reads tokenizer.json itself, or, where it
        cannot tell the decoder's kind (it knows ByteLevel and SentencePiece's byte fallback, not
        e.g. the ``Fuse`` decoder of a character vocabulary: scripts/tiny_chat_model.py's), every
        token's bytes as this tokenizer decodes them, text encoded by this tokenizer."""
        from appliance.core.constraints import llguidance_module, tokenizer_of_bytes

        llguidance_module()  # the missing-library error, said as the APIs say it
        from llguidance import LLTokenizer

        stops = sorted(self.stop_ids) or None
        try:
            return LLTokenizer(self.json, n_vocab=self.size, eos_token=stops)
        except ValueError as exc:
            if "decoder type" not in str(exc):
                raise
        tokens = [self.token_bytes(i) for i in range(self.size)]
        return tokenizer_of_bytes(tokens, self.eos_id, self.special_ids | self.stop_ids,
                                  lambda text: self.encode(text, special=False))


def _stops(config: ReadJSONObject, generation: ReadJSONObject,
           lookup: Callable[[str], int | None]) -> tuple[int | None, frozenset[int]]:
    """(eos id, every id that ends a stream): tokenizer_config's eos_token, generation_config's ids."""
    eos_text = token_text(config.get("eos_token"))
    eos = lookup(eos_text) if eos_text else None
    more = _ids(generation.get("eos_token_id"))
    if eos is None and more:
        eos = more[0]
    return eos, frozenset(([eos] if eos is not None else []) + more)


def _byte_decoder(decoder: object) -> Callable[[str], bytes]:
    """piece -> bytes for one token, by the tokenizer's decoder: byte-level (GPT-2's map of bytes
    to printable characters) or Metaspace/byte-fallback (``▁`` a space, ``<0xAB>`` a byte)."""
    kinds = {d.get("type") for d in (decoder.get("decoders") or [decoder])} if isinstance(decoder, dict) else set()
    if "ByteLevel" in kinds:
        table = {c: b for b, c in _bytes_to_unicode().items()}
        return lambda piece: bytes(table[c] for c in piece if c in table)
    return _metaspace_bytes


def _metaspace_bytes(piece: str) -> bytes:
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    return piece.replace("\u2581", " ").encode("utf-8")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which every byte-level BPE vocabulary uses."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b], extra = chr(256 + extra), extra + 1
    return table


class SentencePieceTokenizer:
    """``tokenizer.model`` through ``sentencepiece`` (module docstring)."""

    def __init__(self, path: str, config: ReadJSONObject, generation: ReadJSONObject):
        import sentencepiece  # lazily: only a version that ships one loads the library

        self.sp = sentencepiece.SentencePieceProcessor()
        try:
            self.sp.Load(path)
        except (OSError, RuntimeError) as exc:
            raise InvalidArgument(f"{SPM_FILE} of this version cannot be read by sentencepiece: {exc}") from exc
        pieces = self.sp.GetPieceSize()
        self.added = added_tokens(config)
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):  # a special token named by the config
            text = token_text(config.get(name))
            if text and self.sp.PieceToId(text) != self.sp.unk_id() and self.sp.PieceToId(text) not in self.added:
                self.added[self.sp.PieceToId(text)] = (text, True)
        self.size = max(pieces, max(self.added, default=-1) + 1)
        control = {i for i in range(pieces) if self.sp.IsControl(i)}
        self.special_ids = frozenset(control | {i for i, (_, special) in self.added.items() if special})
        self._by_text = {text: i for i, (text, _) in self.added.items()}
        self._split = sorted(self._by_text, key=len, reverse=True)
        self.eos_id, self.stop_ids = _stops(config, generation, self._piece_id)
        if self.eos_id is None and self.sp.eos_id() >= 0:
            self.eos_id, self.stop_ids = self.sp.eos_id(), self.stop_ids | {self.sp.eos_id()}
        bos = self.sp.bos_id()
        named = self._piece_id(token_text(config.get("bos_token")))
        self.bos_id = named if named is not None else (bos if bos >= 0 else None)
        self.add_bos = bool(config.get("add_bos_token", True)) and self.bos_id is not None
        self.longest = max((len(self.token_bytes(i)) for i in range(pieces)), default=1) or 1

    def _piece_id(self, text: str) -> int | None:
        if not text:
            return None
        if text in self._by_text:
            return self._by_text[text]
        found = self.sp.PieceToId(text)
        return found if found != self.sp.unk_id() or text == self.sp.IdToPiece(self.sp.unk_id()) else None

    def encode(self, text: str, special: bool = True) -> list[int]:
        ids = [self.bos_id] if special and self.add_bos and self.bos_id is not None else []
        for part, token in self._parts(text):
            ids.extend([token] if token is not None else self.sp.EncodeAsIds(part))
        return ids

    def _parts(self, text: str) -> Iterable[tuple[str, int | None]]:
        """The text cut at added tokens (longest first, leftmost): (text, None) or (token, id)."""
        while text:
            hits = [(text.find(t), -len(t), t) for t in self._split if t in text]
            if not hits:
                yield text, None
                return
            at, _, token = min(hits)
            if at:
                yield text[:at], None
            yield token, self._by_text[token]
            text = text[at + len(token):]

    def decode_all(self, ids: Sequence[int]) -> str:
        out: list[str] = []
        run: list[int] = []
        for token in ids:
            if token in self.added:  # an added token is text of its own (a special one is skipped)
                out.append(self.sp.DecodeIds(run))
                run = []
                out.append("" if self.added[token][1] else self.added[token][0])
            elif token not in self.special_ids and 0 <= token < self.sp.GetPieceSize():
                run.append(token)
        out.append(self.sp.DecodeIds(run))
        return "".join(out)

    def token_bytes(self, token: int) -> bytes:
        if token in self.added:
            return self.added[token][0].encode("utf-8")
        if not 0 <= token < self.sp.GetPieceSize() or self.sp.IsControl(token):
            return b""
        return _metaspace_bytes(self.sp.IdToPiece(token))

    def decode(self, token: int) -> str:
        return self.token_bytes(token).decode("utf-8", errors="replace")

    def fewest_tokens(self, text: str) -> int:
        return -(-len(text.encode("utf-8")) // self.longest)

    def grammar_tokenizer(self) -> LLTokenizer:
        """llguidance's view: every piece's bytes, special ones marked, text encoded by sentencepiece."""
        from appliance.core.constraints import tokenizer_of_bytes

        tokens = [self.token_bytes(i) for i in range(self.size)]
        return tokenizer_of_bytes(tokens, self.eos_id, self.special_ids, self._plain)

    def _plain(self, text: str) -> list[int]:
        """Text encoded without SentencePiece's dummy "▁" prefix (Hugging Face's legacy=False
        trick: encode after the unknown piece's text, drop that part): the grammar engine tokenizes
        pieces of the answer, not a text's beginning, and would otherwise ask for a space first."""
        marker = self.sp.IdToPiece(self.sp.unk_id())
        skip = len(self.sp.EncodeAsIds(marker))
        return list(self.sp.EncodeAsIds(marker + text))[skip:]


def special_text(token: ReadJSONValue) -> str:
    """A special token as tokenizer_config.json writes it (a string, or {"content": ...})."""
    if isinstance(token, dict):  # {"content": "<s>", ...}
        token = token.get("content")
    return token if isinstance(token, str) else ""


def tokenizer_config(version_dir: str) -> JSONObject:
    return read_json(version_dir, "tokenizer_config.json")  # assets/, else the version's root


class Vocabulary:
    """``assets/vocab.json`` of a version: a JSON list of token strings (index = id).
    Text is encoded by greedy longest match, which is exact for character vocabularies.
    ``eos_id``: the token of ``eos_token`` in ``assets/tokenizer_config.json`` (a stream
    ends there), ``special_ids``: its special tokens (``added_tokens_decoder``), which no
    grammar's text may use."""

    def __init__(self, tokens: Sequence[str], eos: str = "", special: Sequence[str] = ()):
        self.tokens = list(tokens)
        self._ids = {t: i for i, t in reversed(list(enumerate(self.tokens)))}
        self.longest = max((len(t) for t in self.tokens), default=1)
        self.eos_id = self._ids.get(eos) if eos else None
        self.stop_ids = frozenset([self.eos_id]) if self.eos_id is not None else frozenset()
        self.special_ids = frozenset(self._ids[t] for t in special if t in self._ids)
        self.size = len(self.tokens)

    @classmethod
    def load(cls, version_dir: str) -> "Vocabulary | None":
        path = os.path.join(version_dir, VOCAB_FILE)
        if not os.path.isfile(path):
            return None
        with open(path, encoding="utf-8") as f:
            tokens = json.load(f)
        if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
            raise InvalidArgument(f"{VOCAB_FILE} of this version is not a JSON list of strings")
        config = tokenizer_config(version_dir)
        added = config.get("added_tokens_decoder")
        special = [t.get("content") for t in added.values() if isinstance(t, dict) and t.get("special")] \
            if isinstance(added, dict) else []
        return cls(tokens, special_text(config.get("eos_token")), [t for t in special if isinstance(t, str)])

    def fewest_tokens(self, text: str) -> int:
        """The fewest tokens ``text`` can take (its length over the longest token's), known
        without encoding it: a prompt over the context is refused before any work."""
        return -(-len(text) // self.longest)

    def encode(self, text: str, special: bool = True) -> list[int]:
        """``special`` is the tokenizers' face (appliance/core/tokenizer.py): a list adds no BOS."""
        ids, i = [], 0
        while i < len(text):
            for size in range(min(self.longest, len(text) - i), 0, -1):
                token = self._ids.get(text[i:i + size])
                if token is not None:
                    ids.append(token)
                    i += size
                    break
            else:
                raise InvalidArgument(f"field 'text': character {text[i]!r} at offset {i} is not in the "
                                      "model's vocabulary")
        return ids

    def decode(self, token: int) -> str:
        return self.tokens[token] if 0 <= token < len(self.tokens) else ""

    def decode_all(self, ids: Sequence[int]) -> str:
        return "".join(self.decode(t) for t in ids if t not in self.special_ids)

    def token_bytes(self, token: int) -> bytes:
        return self.decode(token).encode("utf-8")

    def grammar_tokenizer(self) -> LLTokenizer:
        from appliance.core.constraints import tokenizer_of_bytes

        return tokenizer_of_bytes([t.encode("utf-8") for t in self.tokens], self.eos_id, self.special_ids)


def load(version_dir: str) -> Tokenizer | None:
    """The version's tokenizer (module docstring), or None when it ships none. InvalidArgument
    when a file does not read, or its library is not installed on this device."""
    config, generation = read_json(version_dir, CONFIG_FILE), read_json(version_dir, GENERATION_FILE)
    try:
        path = find(version_dir, HF_FILE)
        if path is not None:
            return HFTokenizer(path, config, generation)
        path = find(version_dir, SPM_FILE)
        if path is not None:
            return SentencePieceTokenizer(path, config, generation)
    except ImportError as exc:  # a lean install: the format's library is missing
        raise MissingLibrary(f"this version's tokenizer needs the {exc.name} package on this device "
                              f"(pip install {exc.name})") from exc
    return Vocabulary.load(version_dir)


def check(version_dir: str) -> None:
    """At load (appliance/core/text.py ``check_assets``): the version's tokenizer files read.
    A missing library is no fault of the version (it may never generate here): its requests say so."""
    try:
        load(version_dir)
    except MissingLibrary:
        pass


__all__ = ["CONFIG_FILE", "VOCAB_FILE", "Vocabulary", "special_text", "tokenizer_config", "Decodes", "Detokenizer", "MissingLibrary", "Tokenizer", "HFTokenizer", "HF_FILE", "SPM_FILE", "SentencePieceTokenizer", "check",
           "find", "load", "read_json", "token_text"]
