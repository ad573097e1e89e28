"""How many members an array under a top-level key holds, counted in a JSON body's bytes before it
is parsed: ``limits.max_instances`` refused before a parser builds an object per instance.

A 16 KB gzip body inflating to ``{"instances": ["a", "a", ...]}`` with 4,194,301 strings stays
under ``limits.max_tensor_elements`` and ``server.max_body_bytes``, yet parsing it builds four
million Python strings (~10 s of a front worker's loop, +360 MB) before the row count is known.
``rows_over`` finds the top-level key's array and counts its members from the raw bytes, one
``CHUNK`` at a time, and stops as soon as the count passes the limit: a bomb costs the bytes up to
its ``limit + 1``-th member, never a parse.

How the bytes are read (numpy over each chunk, no Python per byte): a quote preceded by an odd
run of backslashes is escaped; the real quotes' running parity says which bytes lie inside
strings; ``[``/``{`` and ``]``/``}`` outside strings give each byte's nesting depth. The root
object's keys are the strings that open at depth 1 and are followed by ``:``; a key written
with escapes (``"instanc\\u0065s"``) is decoded (orjson, all such keys of a chunk at once) and
matched as the parser would. The array's members are its commas at its own depth, plus one
unless it is empty. The answer is exact for valid JSON; for a body that is not, it may be wrong,
and the parser refuses that body anyway (a ``rows_over`` that says None lets it parse).

Thread-safety: pure functions.
"""

from __future__ import annotations

import re
from typing import Iterable

import numpy as np
import orjson

CHUNK = 1 << 20  # bytes scanned per numpy pass: bounds the transient arrays (~10 MB)
_STEP = np.zeros(256, np.int8)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1
_QUOTE, _BACKSLASH, _COMMA = ord('"'), ord("\\"), ord(",")
_ARRAY_VALUE = re.compile(rb"[ \t\r\n]*:[ \t\r\n]*\[")
_EMPTY = re.compile(rb"\[[ \t\r\n]*\]")


def rows_over(body: bytes, keys: Iterable[str], limit: int) -> tuple[str, int] | None:
    """(key, count) once an array under a top-level ``key`` of ``body`` (a JSON object) is seen
    to hold ``count`` > ``limit`` members (counting stops there); None when none does."""
    wanted = tuple(keys)
    if len(body) < 2 * limit + 2:  # each member but the last takes two bytes at least ("0,")
        return None
    if b"\\" not in body and not any(b'"' + k.encode() + b'"' in body for k in wanted):
        return None
    return _Scan(body, wanted, limit).run()


class _Scan:
    """One pass over ``body`` in chunks; the state carried from chunk to chunk."""

    def __init__(self, body: bytes, keys: tuple[str, ...], limit: int):
        self.body, self.keys, self.limit = body, keys, limit
        self.raw = np.frombuffer(body, np.uint8)
        self.quoted = [b'"' + k.encode() + b'"' for k in keys]
        self.in_string = 0  # parity carried: 1 when a chunk starts inside a string
        self.backslashes = 0  # backslashes ending the previous chunk (an escape may straddle)
        self.depth = 0
        self.array: tuple[str, int, int] | None = None  # (key, members so far, its '[' position)

    def run(self) -> tuple[str, int] | None:
        for start in range(0, len(self.body), CHUNK):
            over = self.chunk(start, min(len(self.body), start + CHUNK))
            if over is not None:
                return over
        return None

    def chunk(self, start: int, end: int) -> tuple[str, int] | None:
        c = self.raw[start:end]
        quotes = (c == _QUOTE) & ~self.escaped(c)
        parity = (np.cumsum(quotes, dtype=np.int32) + self.in_string) & 1
        outside = (parity == 0) & ~quotes
        depth = np.cumsum(_STEP[c] * outside, dtype=np.int32) + self.depth
        self.in_string, self.depth = int(parity[-1]), int(depth[-1])
        opening = np.flatnonzero(quotes & (parity == 1) & (depth == 1)) + start  # strings at the root's level
        commas = np.flatnonzero((c == _COMMA) & outside & (depth == 2)) + start
        ends = np.flatnonzero((depth == 1) & (_STEP[c] == -1) & outside) + start  # a member array closing
        return self.walk(self.key_arrays(opening, quotes, start), commas, ends)

    def escaped(self, c: np.ndarray) -> np.ndarray:
        """Which bytes of ``c`` follow an odd run of backslashes (the carried run counted)."""
        slashes = c == _BACKSLASH
        carried = self.backslashes
        if not slashes.any() and not carried:
            return np.zeros(len(c), bool)
        index = np.arange(len(c))
        last_other = np.maximum.accumulate(np.where(slashes, -1, index))  # the last non-backslash at or before
        before = np.empty(len(c), np.int64)
        before[0] = carried
        prev = last_other[:-1]
        before[1:] = np.where(prev >= 0, index[1:] - 1 - prev, index[1:] + carried)
        self.backslashes = int(len(c) - 1 - last_other[-1]) if last_other[-1] >= 0 else len(c) + carried
        escaped: np.ndarray = (before & 1).astype(bool) & ~slashes
        return escaped

    def key_arrays(self, opening: np.ndarray, quotes: np.ndarray, start: int) -> list[tuple[int, str]]:
        """('[' position, key) of each array under a wanted key among the strings at ``opening``."""
        found: list[tuple[int, str]] = []
        for key, quoted in zip(self.keys, self.quoted):
            for at in opening[self._matching(opening, quoted)]:
                found.append((int(at) + len(quoted), key))
        if b"\\" in self.body:
            found.extend(self._escaped_keys(opening, quotes, start))
        arrays = []
        for after, key in found:
            match = _ARRAY_VALUE.match(self.body, after)
            if match is not None:
                arrays.append((match.end() - 1, key))
        return sorted(arrays)

    def _matching(self, at: np.ndarray, quoted: bytes) -> np.ndarray:
        ok = at + len(quoted) <= len(self.body)
        for i, byte in enumerate(quoted):
            ok[ok] &= self.raw[at[ok] + i] == byte
        return ok

    def _escaped_keys(self, opening: np.ndarray, quotes: np.ndarray, start: int) -> list[tuple[int, str]]:
        """Keys written with escapes, decoded as the parser decodes them (all of a chunk at once)."""
        closes = np.flatnonzero(quotes) + start
        after = np.searchsorted(closes, opening, side="right")
        longest = 6 * max(len(k) for k in self.keys) + 2  # "\u0069" is six bytes for one character
        inside = after < len(closes)
        ends = np.full(len(opening), -1, np.int64)
        ends[inside] = closes[after[inside]]
        for j in np.flatnonzero(~inside):  # only the chunk's last string can end past it
            ends[j] = _close(self.body, int(opening[j]), longest)
        slashes = np.flatnonzero(self.raw[start:start + CHUNK] == _BACKSLASH) + start
        escaped = np.searchsorted(slashes, ends) > np.searchsorted(slashes, opening)
        near = (ends > opening) & (ends - opening <= longest) & (escaped | ~inside)
        spans = [(int(a), int(b) + 1) for a, b in zip(opening[near], ends[near]) if b"\\" in self.body[a:b]]
        if not spans:
            return []
        try:
            names = orjson.loads(b"[" + b",".join(self.body[a:b] for a, b in spans) + b"]")
        except orjson.JSONDecodeError:  # not JSON: the parser says so
            return []
        return [(b, name) for (_, b), name in zip(spans, names) if name in self.keys]

    def walk(self, arrays: list[tuple[int, str]], commas: np.ndarray, ends: np.ndarray) -> tuple[str, int] | None:
        """Count the commas of the open array (and of those starting here) in order."""
        pending = list(arrays)
        while True:
            if self.array is None:
                if not pending:
                    return None
                at, key = pending.pop(0)
                empty = _EMPTY.match(self.body, at) is not None
                self.array = (key, 0 if empty else 1, at)
            key, members, at = self.array
            closing = ends[np.searchsorted(ends, at, side="right"):]
            stop = int(closing[0]) if len(closing) else len(self.body)
            lo, hi = np.searchsorted(commas, [at, stop])
            members += int(hi - lo)
            if members > self.limit:
                return key, members
            if not len(closing):
                self.array = (key, members, at)
                return None  # it goes on in the next chunk
            self.array = None
            pending = [(a, k) for a, k in pending if a > stop]


_WHITESPACE = np.zeros(256, bool)
_WHITESPACE[[ord(" "), ord("\t"), ord("\r"), ord("\n")]] = True
_OPENS = np.zeros(256, bool)
_OPENS[[ord("["), ord("{")]] = True


def count_values(body: bytes) -> int:
    """The number of non-container values in ``body`` (exact for valid JSON): each comma outside
    strings separates two values, and an empty container holds none. The same chunked pass as
    ``rows_over`` (a regular expression over four million strings took seconds)."""
    scan = _Scan(body, (), 0)
    commas = empties = 0
    last = 0  # the previous chunk's last byte that was neither whitespace nor inside a string
    for start in range(0, len(body), CHUNK):
        c = scan.raw[start:start + CHUNK]
        quotes = (c == _QUOTE) & ~scan.escaped(c)
        parity = (np.cumsum(quotes, dtype=np.int32) + scan.in_string) & 1
        outside = (parity == 0) & ~quotes
        scan.in_string = int(parity[-1])
        commas += int(np.count_nonzero((c == _COMMA) & outside))
        marks = c[(outside & ~_WHITESPACE[c]) | quotes]  # the skeleton: brackets, commas, quotes, literals
        if not len(marks):
            continue
        pairs = np.concatenate(([last], marks[:-1])) if last else marks[:-1]
        closes = marks if last else marks[1:]
        empties += int(np.count_nonzero(_OPENS[pairs] & (_STEP[closes] == -1) & (closes - pairs == 2)))
        last = int(marks[-1])
    return commas + 1 - empties


def _close(body: bytes, at: int, longest: int) -> int:
    """The real quote closing the string opened at ``at``, looked for within ``longest`` bytes; -1."""
    end = min(len(body), at + longest + 1)
    pos = at + 1
    while pos < end:
        if body[pos] == _BACKSLASH:
            pos += 2
            continue
        if body[pos] == _QUOTE:
            return pos
        pos += 1
    return -1
