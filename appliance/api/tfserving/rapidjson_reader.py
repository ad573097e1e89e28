"""Where and why TF Serving's JSON parser stops: rapidjson 1.1.0's reader, for bodies orjson refused.

TF Serving parses a REST body with rapidjson (util/json_tensor.cc ``ParseJson``, the version
pinned in tensorflow_serving/workspace.bzl) with ``kParseIterativeFlag | kParseNanAndInfFlag |
kParseStopWhenDoneFlag``, and answers a failure as::

    JSON Parse error: <GetParseError_En(code)> at offset: <GetErrorOffset()>

``read(body)`` walks the body as rapidjson's ``IterativeParse`` does (reader.h: the state
table, ``HandleError``, ``ParseString``, ``ParseNumber`` with NaN/Inf) and returns either
that text, or the span of the root value rapidjson accepts. It runs only after orjson has
refused a body, so it may be plain Python: runs of scalars and of flat arrays of scalars
(a tensor's bulk) are consumed by one regular expression each, and a body that would
still take more than ``MAX_STEPS`` steps gets ``None`` (the caller keeps orjson's words).

What rapidjson does that orjson does not, and so can only be seen here: it stops after the
root value (``kParseStopWhenDoneFlag``: trailing text is ignored, so "The document root must
not be followed by other values." never happens), skips a UTF-8 byte-order mark, reads a NUL
byte as the end of the body, reads ``NaN``, ``Inf`` and ``Infinity`` (signed), and does not
check that strings are valid UTF-8.
"""

from __future__ import annotations

import re
import sys
from typing import NamedTuple

MAX_STEPS = 200_000  # tokens walked one by one (runs count once); ~0.2 s of Python at most

# error/en.h GetParseError_En, by rapidjson's ParseErrorCode names
DOCUMENT_EMPTY = "The document is empty."
VALUE_INVALID = "Invalid value."
OBJECT_MISS_NAME = "Missing a name for object member."
OBJECT_MISS_COLON = "Missing a colon after a name of object member."
OBJECT_MISS_COMMA_OR_CURLY = "Missing a comma or '}' after an object member."
ARRAY_MISS_COMMA_OR_SQUARE = "Missing a comma or ']' after an array element."
STRING_ESCAPE_INVALID_HEX = "Incorrect hex digit after \\u escape in string."
STRING_SURROGATE_INVALID = "The surrogate pair in string is invalid."
STRING_ESCAPE_INVALID = "Invalid escape character in string."
STRING_MISS_QUOTATION_MARK = "Missing a closing quotation mark in string."
NUMBER_TOO_BIG = "Number too big to be stored in double."
NUMBER_MISS_FRACTION = "Miss fraction part in number."
NUMBER_MISS_EXPONENT = "Miss exponent in number."


class Verdict(NamedTuple):
    """``error``: TF Serving's whole text, or None when rapidjson accepts the body; then
    ``start:end`` is the root value it read (after a byte-order mark, before trailing text)."""
    error: str | None
    start: int = 0
    end: int = 0


class _Error(Exception):
    def __init__(self, text: str, offset: int):
        super().__init__(text)
        self.text, self.offset = text, offset


class _TooLong(Exception):
    pass


# IterativeParsingState (reader.h), in its order
(START, FINISH, ERROR, OBJ_INIT, MEMBER_KEY, KV_DELIM, MEMBER_VALUE, MEMBER_DELIM, OBJ_FINISH, ARR_INIT, ELEMENT,
 ELEM_DELIM, ARR_FINISH, VALUE) = range(14)
# Token (reader.h Tokenize): anything else is a NumberToken
_LB, _RB, _LC, _RC, _COMMA, _COLON, _STRING, _FALSE, _TRUE, _NULL, _NUMBER = range(11)
_TOKEN = {ord("["): _LB, ord("]"): _RB, ord("{"): _LC, ord("}"): _RC, ord(","): _COMMA, ord(":"): _COLON,
          ord('"'): _STRING, ord("f"): _FALSE, ord("t"): _TRUE, ord("n"): _NULL}
_E = ERROR
_VALUE_ROW = (ARR_INIT, _E, OBJ_INIT, _E, _E, _E)  # "[" "]" "{" "}" "," ":" where a value may start
# reader.h Predict's table G: state x token -> state (ERROR where none)
_PREDICT = {
    START: (*_VALUE_ROW, VALUE, VALUE, VALUE, VALUE, VALUE),
    OBJ_INIT: (_E, _E, _E, OBJ_FINISH, _E, _E, MEMBER_KEY, _E, _E, _E, _E),
    MEMBER_KEY: (_E, _E, _E, _E, _E, KV_DELIM, _E, _E, _E, _E, _E),
    KV_DELIM: (*_VALUE_ROW, MEMBER_VALUE, MEMBER_VALUE, MEMBER_VALUE, MEMBER_VALUE, MEMBER_VALUE),
    MEMBER_VALUE: (_E, _E, _E, OBJ_FINISH, MEMBER_DELIM, _E, _E, _E, _E, _E, _E),
    MEMBER_DELIM: (_E, _E, _E, OBJ_FINISH, _E, _E, MEMBER_KEY, _E, _E, _E, _E),
    ARR_INIT: (ARR_INIT, ARR_FINISH, OBJ_INIT, _E, _E, _E, ELEMENT, ELEMENT, ELEMENT, ELEMENT, ELEMENT),
    ELEMENT: (_E, ARR_FINISH, _E, _E, ELEM_DELIM, _E, _E, _E, _E, _E, _E),
    ELEM_DELIM: (ARR_INIT, ARR_FINISH, OBJ_INIT, _E, _E, _E, ELEMENT, ELEMENT, ELEMENT, ELEMENT, ELEMENT),
}
# reader.h HandleError: the error a state reports when the next token does not fit it
_HANDLE_ERROR = {START: DOCUMENT_EMPTY, OBJ_INIT: OBJECT_MISS_NAME, MEMBER_DELIM: OBJECT_MISS_NAME,
                 MEMBER_KEY: OBJECT_MISS_COLON, MEMBER_VALUE: OBJECT_MISS_COMMA_OR_CURLY, KV_DELIM: VALUE_INVALID,
                 ARR_INIT: VALUE_INVALID, ELEM_DELIM: VALUE_INVALID, ELEMENT: ARRAY_MISS_COMMA_OR_SQUARE}
_ESCAPES = frozenset(b'"/\\bfnrt')
_HEX = frozenset(b"0123456789abcdefABCDEF")
_DIGITS = frozenset(b"0123456789")
_WS = re.compile(rb"[ \t\n\r]*")
_PLAIN = re.compile(rb'[^"\\\x00-\x1f]*')  # the part of a string rapidjson copies as it is

# Runs that rapidjson reads without error, consumed at once (never anything it could refuse:
# numbers whose digits cannot overflow a double, strings without escapes or control bytes).
# Possessive quantifiers (Python 3.11+) make the same match ten times faster: nothing that
# follows a run is ever found by giving part of it back.
_P = "+" if sys.version_info >= (3, 11) else ""
_NUM = rf"-?(?:0|[1-9][0-9]{{0,17}}{_P})(?:\.[0-9]+{_P})?{_P}(?:[eE][+-]?[0-9]{{1,2}}{_P})?{_P}(?![0-9.eE])"
_SCALAR = rf'(?:{_NUM}|"[^"\\\x00-\x1f]*{_P}"|true|false|null)'
_SEP = r"[ \t\n\r]*,[ \t\n\r]*"
_FLAT = rf"\[[ \t\n\r]*(?:{_SCALAR}(?:{_SEP}{_SCALAR})*{_P}[ \t\n\r]*)?\]"
_ITEM = rf"(?:{_SCALAR}|{_FLAT})"
_ELEMENTS = re.compile(rf"{_ITEM}(?:{_SEP}{_ITEM})*{_P}".encode())


def read(body: bytes) -> Verdict | None:
    """rapidjson's verdict on ``body`` as TF Serving parses it; None past ``MAX_STEPS``."""
    end = body.find(b"\0")
    data = body if end < 0 else body[:end]  # MemoryStream::Peek reads a NUL as the end
    try:
        start, stop = _Reader(data).parse()
    except _Error as err:
        return Verdict(f"JSON Parse error: {err.text} at offset: {err.offset}")
    except _TooLong:
        return None
    return Verdict(None, start, stop)


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.n, self.pos, self.steps = data, len(data), 0, 0

    def peek(self) -> int:
        return self.data[self.pos] if self.pos < self.n else 0

    def consume(self, char: str) -> bool:
        if self.peek() == ord(char):
            self.pos += 1
            return True
        return False

    def skip_ws(self) -> None:
        self.pos = _WS.match(self.data, self.pos).end()  # type: ignore[union-attr]

    def parse(self) -> tuple[int, int]:
        """reader.h IterativeParse with kParseStopWhenDoneFlag: (start, end) of the root value."""
        for byte in b"\xef\xbb\xbf":  # EncodedInputStream<UTF8<>, MemoryStream> skips a BOM, byte by byte
            if self.peek() == byte:
                self.pos += 1
        self.skip_ws()
        start, state, stack = self.pos, START, []
        while self.peek():
            self.steps += 1
            if self.steps > MAX_STEPS:
                raise _TooLong
            token = _TOKEN.get(self.peek(), _NUMBER)
            row = _PREDICT.get(state)
            state = self.transit(state, token, row[token] if row else ERROR, stack)
            if state == FINISH:
                return start, self.pos
            self.skip_ws()
        raise _Error(_HANDLE_ERROR.get(state, DOCUMENT_EMPTY), self.pos)  # the end came too early

    def transit(self, src: int, token: int, dst: int, stack: list[int]) -> int:
        if dst == ERROR:
            raise _Error(_HANDLE_ERROR[src], self.pos)
        if dst in (OBJ_INIT, ARR_INIT):
            stack.append(ELEMENT if src in (ARR_INIT, ELEM_DELIM) else MEMBER_VALUE if src == KV_DELIM else src)
            self.pos += 1
            if dst == ARR_INIT:
                return self.elements()
            return dst
        if dst == MEMBER_KEY:
            self.string()
        elif dst in (KV_DELIM, MEMBER_DELIM):
            self.pos += 1
        elif dst == ELEM_DELIM:
            self.pos += 1
            return self.elements(ELEM_DELIM)
        elif dst in (OBJ_FINISH, ARR_FINISH):
            if src in (MEMBER_DELIM, ELEM_DELIM):  # a trailing comma (kParseTrailingCommasFlag is off)
                raise _Error(OBJECT_MISS_NAME if src == MEMBER_DELIM else VALUE_INVALID, self.pos)
            back = stack.pop()
            self.pos += 1
            return FINISH if back == START else back
        else:  # MEMBER_VALUE, ELEMENT, VALUE: a scalar
            self.value()
            return FINISH if dst == VALUE else dst
        return dst

    def elements(self, state: int = ARR_INIT) -> int:
        """After "[" or ",": a run of scalars and flat arrays of scalars in one match."""
        self.skip_ws()
        run = _ELEMENTS.match(self.data, self.pos)
        if run is None or run.end() == self.pos:
            return state
        self.pos = run.end()
        return ELEMENT

    def value(self) -> None:
        """reader.h ParseValue for a scalar."""
        first = self.peek()
        if first == ord('"'):
            self.string()
            return
        literal = {ord("n"): "ull", ord("t"): "rue", ord("f"): "alse"}.get(first)
        if literal is None:
            self.number()
            return
        self.pos += 1
        for char in literal:
            if not self.consume(char):
                raise _Error(VALUE_INVALID, self.pos)

    def string(self) -> None:
        """reader.h ParseString / ParseStringToStream (no encoding validation)."""
        self.pos += 1  # the opening quote
        data = self.data
        while True:
            self.pos = _PLAIN.match(data, self.pos).end()  # type: ignore[union-attr]
            c = self.peek()
            if c == ord('"'):
                self.pos += 1
                return
            if c == ord("\\"):
                escape = self.pos
                self.pos += 1
                e = self.peek()
                if e in _ESCAPES:
                    self.pos += 1
                elif e == ord("u"):
                    self.pos += 1
                    code = self.hex4(escape)
                    if 0xD800 <= code <= 0xDBFF:  # a high surrogate needs a low one next
                        if not (self.consume("\\") and self.consume("u")):
                            raise _Error(STRING_SURROGATE_INVALID, escape)
                        if not 0xDC00 <= self.hex4(escape) <= 0xDFFF:
                            raise _Error(STRING_SURROGATE_INVALID, escape)
                else:
                    raise _Error(STRING_ESCAPE_INVALID, escape)
            elif c == 0:
                raise _Error(STRING_MISS_QUOTATION_MARK, self.pos)
            else:  # a control byte: rapidjson 1.1.0 says "invalid escape" for it
                raise _Error(STRING_ESCAPE_INVALID, self.pos)

    def hex4(self, escape: int) -> int:
        code = 0
        for _ in range(4):
            c = self.peek()
            if c not in _HEX:
                raise _Error(STRING_ESCAPE_INVALID_HEX, escape)
            code = code * 16 + int(chr(c), 16)
            self.pos += 1
        return code

    def digit(self) -> int | None:
        c = self.peek()
        return c - 48 if c in _DIGITS else None

    def number(self) -> None:
        """reader.h ParseNumber with kParseNanAndInfFlag: only what decides an error."""
        start = self.pos
        minus = self.consume("-")
        i = i64 = significant = exp_frac = 0
        use64 = use_double = False
        d = 0.0
        first = self.digit()
        if first == 0:
            self.pos += 1
        elif first is not None:
            i = first
            self.pos += 1
            limit, last = (214748364, 8) if minus else (429496729, 5)  # 2^31, 2^32 - 1
            while (k := self.digit()) is not None:
                if i >= limit and (i != limit or k > last):
                    i64, use64 = i, True
                    break
                i, significant, self.pos = i * 10 + k, significant + 1, self.pos + 1
        elif self.peek() in (ord("I"), ord("N")):
            if not (self.consume("N") and self.consume("a") and self.consume("N")):
                if self.consume("I") and self.consume("n") and self.consume("f"):
                    if self.peek() == ord("i") and not all(self.consume(c) for c in "inity"):
                        raise _Error(VALUE_INVALID, self.pos)
                else:
                    raise _Error(VALUE_INVALID, self.pos)
        else:
            raise _Error(VALUE_INVALID, self.pos)
        if use64:
            limit, last = (0x0CCCCCCCCCCCCCCC, 8) if minus else (0x1999999999999999, 5)  # 2^63, 2^64 - 1
            while (k := self.digit()) is not None:
                if i64 >= limit and (i64 != limit or k > last):
                    d, use_double = float(i64), True
                    break
                i64, significant, self.pos = i64 * 10 + k, significant + 1, self.pos + 1
        if use_double:  # an integer past 64 bits
            while (k := self.digit()) is not None:
                if d >= 1.7976931348623157e307:  # DBL_MAX / 10
                    raise _Error(NUMBER_TOO_BIG, start)
                d, self.pos = d * 10 + k, self.pos + 1
        if self.consume("."):
            if self.digit() is None:
                raise _Error(NUMBER_MISS_FRACTION, self.pos)
            if not use_double:
                if not use64:
                    i64 = i
                while (k := self.digit()) is not None and i64 <= 0x1FFFFFFFFFFFFF:  # 2^53 - 1
                    i64, exp_frac, self.pos = i64 * 10 + k, exp_frac - 1, self.pos + 1
                    significant += i64 != 0
                d, use_double = float(i64), True
            while (k := self.digit()) is not None:
                self.pos += 1
                if significant < 17:
                    d, exp_frac = d * 10 + k, exp_frac - 1
                    significant += d > 0
        if self.consume("e") or self.consume("E"):
            negative = not self.consume("+") and self.consume("-")
            if self.digit() is None:
                raise _Error(NUMBER_MISS_EXPONENT, self.pos)
            exp, most = 0, 308 - exp_frac
            while (k := self.digit()) is not None:
                exp, self.pos = exp * 10 + k, self.pos + 1
                if not negative and exp > most:
                    raise _Error(NUMBER_TOO_BIG, start)
