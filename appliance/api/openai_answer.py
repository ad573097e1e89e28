"""One OpenAI request's streams read as OpenAI's answer: choices, text with stop strings cut,
logprobs, tool calls, finish reasons, usage; whole (``completion``) or as SSE chunks
(``chunks``). appliance/api/openai.py starts the streams; this module only reads them.

Events come tagged with their choice's index from one ``TokenStream`` (appliance/core/token_streams.py),
awaited on the request's event loop.
Logprobs are one entry per generated token, OpenAI's shapes: chat ``{"content": [{"token",
"logprob", "bytes", "top_logprobs"}]}``, completions ``{"tokens", "token_logprobs",
"top_logprobs", "text_offset"}``. An answer that may be a tool call (``Tools.reads_calls``)
is held back while streaming and sent as ``tool_calls`` deltas (the call, then its
arguments) or streamed as text as soon as it cannot be one. Not thread-safe: one reader per request.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator, Callable, Iterator

import orjson

from appliance.api.openai_tools import Tools
from appliance.core.streams import Stream
from appliance.core.seams import TokenEvents
from appliance.core.streams import TokenLogprob
from appliance.core.text import StopText
from appliance.core.tokenizer import Detokenizer

POLL_S = 0.25  # at most how often a whole answer's reader looks whether its client is still there


class Choice:
    """One stream's text, logprobs and end."""

    def __init__(self, stream: Stream, stops: list[str], vocab: Any):
        self.stream, self.stop = stream, StopText(stops)
        # token-level: text by the tokenizer's incremental detokenizer (never a split character)
        self.detokenizer = None if stream.text_level else Detokenizer(vocab, stream.prompt)
        self.text: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.tokens = 0
        self.finish_reason: str | None = None
        self.error: str | None = None

    @property
    def index(self) -> int:
        return self.stream.index

    def feed(self, kind: str, value: Any) -> tuple[str, list[TokenLogprob]]:
        """One event -> (text that may be shown, the logprobs of its tokens)."""
        if kind in ("token", "text"):
            if self.finish_reason is not None:  # after a stop string: neither shown nor counted
                return "", []
            self.tokens += 1
            logprob = self.stream.logprobs[self.tokens - 1:self.tokens] if kind == "token" else []
            piece = self.detokenizer.feed(value) if self.detokenizer is not None else value
            text, stopped = self.stop.feed(piece)
            if stopped:
                self.stream.cancel("stop")  # ended at its next step; its handle released there
                self.finish_reason = "stop"
            self.text.append(text)
            self.logprobs += logprob
            return text, logprob
        held = ""
        if self.detokenizer is not None and self.finish_reason is None:  # the last, incomplete character
            held, stopped = self.stop.feed(self.detokenizer.flush())
            self.finish_reason = "stop" if stopped else None
        held += self.stop.flush()
        if self.finish_reason is None:
            if kind == "error":
                self.error = str(value)
            else:
                self.finish_reason = "stop" if value["finish_reason"] == "stop" else "length"
        self.text.append(held)
        return held, []


class Answer:
    """The request's choices (module docstring)."""

    def __init__(self, tokens: TokenEvents, vocab: Any, body: dict[str, Any], chat: bool, prompt_tokens: int,
                 stops: list[str], tools: Tools | None, gone: Callable[[], bool]):
        streams = self.streams = tokens.streams
        self.tokens, self.vocab, self.chat, self.tools = tokens, vocab, chat, tools
        self.choices = [Choice(s, stops, vocab) for s in streams]
        self.streaming = bool(body.get("stream", False))
        self.include_usage = bool((body.get("stream_options") or {}).get("include_usage", False))
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.answered_by = f"{streams[0].model}:{streams[0].version}"  # the id of the version that answered
        self.prompt_tokens = prompt_tokens
        self.logprobs = streams[0].params.logprobs
        self.gone = gone
        self._look_at = time.monotonic() + POLL_S  # when to look next whether the client is gone

    @property
    def error(self) -> str | None:
        return next((c.error for c in self.choices if c.error is not None), None)

    def cancel(self) -> None:
        self.tokens.abort()

    async def next_event(self) -> tuple[Choice, str, list[TokenLogprob]] | None:
        """The next event of any choice as (choice, text, logprobs); None when all ended."""
        if not self.tokens.open:
            return None
        index, kind, value = await anext(self.tokens)
        if not self.streaming:  # a whole answer writes nothing until its end: look whether its client left
            self._look()
        choice = self.choices[index]
        return (choice, *choice.feed(kind, value))

    def _look(self) -> None:
        now = time.monotonic()
        if now >= self._look_at:
            self._look_at = now + POLL_S
            if self.gone():
                self.cancel()  # the streams end at their next step; their "done" events follow

    def usage(self) -> dict[str, int]:
        done = sum(c.tokens for c in self.choices)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
                "total_tokens": self.prompt_tokens + done}

    def head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.answered_by}

    # -- the whole answer ----------------------------------------------------------------------
    async def completion(self) -> dict[str, Any]:
        while await self.next_event() is not None:
            pass
        return {**self.head("chat.completion" if self.chat else "text_completion"),
                "choices": [self._whole(c) for c in self.choices], "usage": self.usage()}

    def _whole(self, choice: Choice) -> dict[str, Any]:
        text = "".join(choice.text)
        logprobs = self._logprobs(choice.logprobs, 0) if self.logprobs is not None else None
        if not self.chat:
            return {"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": choice.finish_reason}
        calls, finish = self._calls(choice, text)
        message: dict[str, Any] = {"role": "assistant", "content": None if calls else text, "refusal": None}
        if calls:
            message["tool_calls"] = calls
        return {"index": choice.index, "message": message, "logprobs": logprobs, "finish_reason": finish}

    def _calls(self, choice: Choice, text: str) -> tuple[list[dict[str, Any]] | None, str | None]:
        """(the tool calls of a choice's text, its finish reason): ``tool_calls`` for whole calls;
        ``length`` with the call so far for one the length limit cut (OpenAI's report of it)."""
        if self.tools is None:
            return None, choice.finish_reason
        calls = self.tools.calls(text)
        if calls:
            return calls, "tool_calls"
        if choice.finish_reason == "length":
            return self.tools.cut_call(text), "length"
        return None, choice.finish_reason

    # -- logprobs, OpenAI's shapes -------------------------------------------------------------
    def _logprobs(self, entries: list[TokenLogprob], offset: int) -> dict[str, Any]:
        if self.chat:
            return {"content": [self._chat_entry(e) for e in entries], "refusal": None}
        text_offset, tokens = [], []
        for e in entries:
            text_offset.append(offset)
            tokens.append(self.vocab.decode(e.token))
            offset += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self.vocab.decode(t): lp for t, lp in e.top} for e in entries],
                "text_offset": text_offset}

    def _chat_entry(self, entry: TokenLogprob) -> dict[str, Any]:
        def one(token: int, logprob: float) -> dict[str, Any]:  # bytes: the token's own, a split character too
            raw = self.vocab.token_bytes(token)
            return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

        return {**one(entry.token, entry.logprob), "top_logprobs": [one(t, lp) for t, lp in entry.top]}

    # -- server-sent chunks --------------------------------------------------------------------
    async def chunks(self) -> AsyncIterator[bytes]:
        """Every chunk but the error event and [DONE] (the caller writes those). With tools, a
        choice's text is held only while it may still be a call (OpenAI streams content until a
        call starts): text that cannot begin one is flushed and streamed from then on; a call is
        sent whole once known."""
        tools = self.tools if self.tools is not None and self.tools.reads_calls else None
        holding = [tools is not None] * len(self.choices)
        buffered: list[tuple[str, list[TokenLogprob]]] = [("", []) for _ in self.choices]
        if self.chat:
            for choice in self.choices:
                yield self.chunk(choice.index, {"role": "assistant", "content": ""})
        offsets = [0] * len(self.choices)
        while (event := await self.next_event()) is not None:
            choice, text, logprobs = event
            i = choice.index
            if holding[i] and tools is not None:
                text, logprobs = buffered[i][0] + text, buffered[i][1] + logprobs
                if tools.may_be_call(text):
                    buffered[i] = (text, logprobs)
                    continue
                holding[i] = False  # not a call: what was held goes out now, the rest as it comes
            if not text and not logprobs:
                continue
            lp = self._logprobs(logprobs, offsets[i]) if self.logprobs is not None else None
            offsets[i] += len(text)
            yield self.chunk(i, {"content": text} if self.chat else text, logprobs=lp)
        if self.error is not None:
            return
        for choice in self.choices:
            for chunk in self._ending(choice, holding[choice.index]):
                yield chunk
        if self.include_usage:
            yield _event({**self.head(self._kind), "choices": [], "usage": self.usage()})

    def _ending(self, choice: Choice, held: bool) -> Iterator[bytes]:  # (sync: it waits for nothing)
        finish = choice.finish_reason
        if held:
            text = "".join(choice.text)
            calls, finish = self._calls(choice, text)
            if calls:
                for i, call in enumerate(calls):
                    named = {**call, "index": i, "function": {"name": call["function"]["name"], "arguments": ""}}
                    yield self.chunk(choice.index, {"tool_calls": [named]})
                    yield self.chunk(choice.index, {"tool_calls": [
                        {"index": i, "function": {"arguments": call["function"]["arguments"]}}]})
            elif text:
                yield self.chunk(choice.index, {"content": text})
        yield self.chunk(choice.index, {} if self.chat else "", finish=finish)

    @property
    def _kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def chunk(self, index: int, delta: Any, finish: str | None = None, logprobs: Any = None) -> bytes:
        choice: dict[str, Any] = {"index": index, "delta": delta} if self.chat else {"index": index, "text": delta}
        choice.update({"logprobs": logprobs, "finish_reason": finish})
        return _event({**self.head(self._kind), "choices": [choice], **({"usage": None} if self.include_usage else {})})


def _event(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


__all__ = ["Answer", "Choice"]
