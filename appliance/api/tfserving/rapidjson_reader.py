"""Where and why TF Serving's JSON parser stops, for bodies orjson refused: rapidjson itself.

TF Serving parses a REST body with rapidjson 1.1.0 (util/json_tensor.cc ``ParseJson``, the
version pinned in tensorflow_serving/workspace.bzl) with ``kParseIterativeFlag |
kParseNanAndInfFlag | kParseStopWhenDoneFlag`` and answers a failure as::

    JSON Parse error: <GetParseError_En(code)> at offset: <GetErrorOffset()>

python-rapidjson runs rapidjson's own reader and error words (``number_mode=NM_NATIVE |
NM_NAN``: rapidjson reads the numbers, NaN and Infinity included). But it bundles a later
rapidjson (a 2025 git checkout that still calls itself 1.1.0), runs its recursive parser,
and sets neither of TF Serving's other flags, so ``read`` adds what TF Serving's parse does:

- a UTF-8 byte-order mark is skipped (``EncodedInputStream<UTF8<>, MemoryStream>``), and
  offsets still count from the body's first byte;
- a NUL byte is read as the end of the body (``MemoryStream::Peek``);
- strings are not checked for UTF-8 (python-rapidjson takes only UTF-8 text);
- whatever follows the root value is ignored (``kParseStopWhenDoneFlag``);
- the iterative parser's words where the recursive one's differ, and 1.1.0's where the
  later rapidjson's do (``_as_tf_serving_words``);
- the iterative parser has no depth limit; python-rapidjson stops at Python's recursion
  limit (1000), past any ``max_json_depth``: ``read`` returns None, the caller says "too deep".

Compared with rapidjson 1.1.0 run as TF Serving's ParseJson on 350,000 fuzzed bodies,
``read`` differs only where the later rapidjson refuses what 1.1.0 takes, and the decoder
refused each of those before too (orjson refuses what 1.1.0 reads there), now in rapidjson's
words: a lone low surrogate escape (save in a body with NaN, which Python's json took), ``NaN``
or ``Inf`` followed by ``.`` or ``e``, and ``NInf`` (1.1.0 reads on), and a double that
overflows only once scaled by its exponent, ``6e308`` (1.1.0 reads infinity).
"""

from __future__ import annotations

import re
from typing import NamedTuple

import rapidjson

_NUMBERS = rapidjson.NM_NATIVE | rapidjson.NM_NAN  # rapidjson's own number reader, with NaN and Infinity
_ERROR = re.compile(r"Parse error at offset (\d+): (.*)", re.S)  # python-rapidjson's JSONDecodeError text
_ROOT_NOT_SINGULAR = "The document root must not be followed by other values."
_NOT_UTF8 = re.compile("[\udc80-\udcff]")  # the bytes ``surrogateescape`` could not decode
_WHITESPACE = re.compile(rb"[ \t\n\r]*")
_TF_SERVING_WORDS = {"Invalid encoding in string.": "Invalid escape character in string."}  # 1.1.0's, for a control byte


class Verdict(NamedTuple):
    """``error``: TF Serving's whole text, or None when rapidjson accepts the body; then
    ``start:end`` is the root value it read (after a byte-order mark, before trailing text)."""
    error: str | None
    start: int = 0
    end: int = 0


def read(body: bytes) -> Verdict | None:
    """rapidjson's verdict on ``body`` as TF Serving parses it; None when it nests deeper
    than python-rapidjson follows (module docstring)."""
    nul = body.find(b"\0")
    data = body if nul < 0 else body[:nul]  # MemoryStream::Peek reads a NUL as the end
    start = _bom_length(data)
    try:
        rapidjson.loads(_as_utf8(data[start:]), number_mode=_NUMBERS)
    except RecursionError:
        return None
    except rapidjson.JSONDecodeError as exc:
        found = _ERROR.fullmatch(str(exc))
        if found is None:
            raise
        offset, words = start + int(found.group(1)), found.group(2)
        if words == _ROOT_NOT_SINGULAR:  # kParseStopWhenDoneFlag: the root value ended before it
            return Verdict(None, start, _root_end(data, offset))
        return Verdict(f"JSON Parse error: {_as_tf_serving_words(words, offset, data, start)} at offset: {offset}")
    return Verdict(None, start, _root_end(data, len(data)))


def _root_end(data: bytes, end: int) -> int:
    """Where the root value before ``end`` ends: TF Serving's parse stops right after it."""
    return len(data[:end].rstrip(b" \t\n\r"))


def _as_tf_serving_words(words: str, offset: int, data: bytes, start: int) -> str:
    """What TF Serving's parse says where python-rapidjson's says ``words``."""
    white = _WHITESPACE.match(data, start)  # whitespace or none: it always matches
    if words == "Invalid value." and white is not None and offset == white.end() \
            and data[offset:offset + 1] in (b"]", b"}", b",", b":"):
        return "The document is empty."  # the iterative parser's start state, for a token no value starts with
    return _TF_SERVING_WORDS.get(words, words)


def _bom_length(data: bytes) -> int:
    """EncodedInputStream<UTF8<>, MemoryStream> takes 0xEF, then 0xBB, then 0xBF, each if it is next."""
    at = 0
    for byte in b"\xef\xbb\xbf":
        if data[at:at + 1] == bytes((byte,)):
            at += 1
    return at


def _as_utf8(data: bytes) -> str:
    """``data`` as text python-rapidjson takes, each byte that is not UTF-8 as one "?": rapidjson
    1.1.0 copies such bytes inside a string and refuses them outside one, as it does "?"."""
    try:
        return data.decode()
    except UnicodeDecodeError:
        return _NOT_UTF8.sub("?", data.decode(errors="surrogateescape"))
