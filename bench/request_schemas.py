"""What declaring the request bodies costs: msgspec Structs against pydantic models.

Two figures chose appliance/api/schemas/ (its docstring):

* **decode**: a typical chat body (3 messages, one tool, sampling fields, ~1.1 KB) checked by
  (a) the service's path (``openai_fields.read`` and the helpers the handler calls),
  (b) ``orjson.loads`` + ``msgspec.convert`` to the declared Struct, (c) ``msgspec.json.decode``
  to it, (d) pydantic's ``model_validate_json``, (e) ``orjson.loads`` + ``model_validate``;
  the median of ``--rounds`` rounds of ``-n`` calls, in microseconds per body;
* **memory**: a fresh interpreter that already imports msgspec, orjson, numpy and the core's
  errors and sampling (as a front worker does), then the Structs declared, or pydantic imported and the same models declared:
  RSS and USS growth (psutil), the median of ``--procs`` interpreters each.

Run: ``PYTHONPATH=. .venv/bin/python bench/request_schemas.py [-n 20000] [--rounds 5] [--procs 3]``;
the service path before the declarations: ``git archive 11189f4 appliance | tar -x -C /tmp/old`` and
``PYTHONPATH=/tmp/old .venv/bin/python bench/request_schemas.py --service-only``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

BODY = {"model": "tiny", "messages": [
    {"role": "system", "content": "You are a terse assistant that answers in one line."},
    {"role": "user", "content": "What is the weather in Paris and in Berlin today? Use the tool."},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]}],
    "tools": [{"type": "function", "function": {"name": "weather", "description": "today's weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}],
    "tool_choice": "auto", "max_tokens": 64, "temperature": 0.7, "top_p": 0.9, "stop": ["\n\n"], "seed": 7,
    "n": 1, "stream": True, "stream_options": {"include_usage": True}, "presence_penalty": 0.1,
    "frequency_penalty": 0.1, "logit_bias": {"42": -5}, "top_k": 40, "min_p": 0.05, "logprobs": True,
    "top_logprobs": 2, "user": "bench"}

PYDANTIC_MODELS = '''
from typing import Annotated, Any, Literal
from pydantic import BaseModel, ConfigDict, Field

class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool | None = None
class Function(BaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: Function
class CalledFunction(BaseModel):
    name: str
    arguments: str | dict[str, Any] = "{}"
class ToolCall(BaseModel):
    function: CalledFunction
    id: str | None = None
    type: Literal["function"] = "function"
class TextPart(BaseModel):
    type: Literal["text"]
    text: str
class Message(BaseModel):
    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None
class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: Annotated[str, Field(min_length=1)]
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    seed: int | None = None
    n: Annotated[int, Field(ge=1, le=8)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: dict[str, Any] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=100)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
'''

MEMORY_PROBE = '''
import gc, json, os, sys
import msgspec, orjson, psutil
import appliance.core.errors, appliance.core.sampling  # what a front worker holds already (numpy too)
def mem():
    gc.collect(); info = psutil.Process().memory_full_info(); return info.rss, info.uss
before = mem()
if sys.argv[1] == "msgspec":
    import appliance.api.schemas.openai as o, appliance.api.schemas as s
    s.components(o.REQUESTS + o.ANSWERS)  # what /openapi.json builds once
    msgspec.convert(json.loads(sys.argv[2]), o.ChatRequest)
else:
    ns = {}
    exec(compile(sys.argv[3], "models", "exec"), ns)
    ns["ChatRequest"].model_validate_json(sys.argv[2])
    ns["ChatRequest"].model_json_schema()
after = mem()
print(json.dumps({"rss": after[0] - before[0], "uss": after[1] - before[1]}))
'''


def _hand(raw: bytes) -> Callable[[], Any]:
    from appliance.api import openai_fields as fields
    from appliance.core.config import GenerationConfig

    config = GenerationConfig()

    def run() -> Any:
        body = fields.read(raw, fields.CHAT)
        fields.model_id(body["model"])
        fields.messages(body)
        fields.choices(body)
        return fields.params(body, config, True, frozenset(), 1000, 32000), fields.stops(body)
    return run


def _timed(call: Callable[[], Any], n: int, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(n):
            call()
        times.append((time.perf_counter() - start) / n * 1e6)
    return statistics.median(times)


def decode(n: int, rounds: int, service_only: bool = False) -> dict[str, float]:
    import msgspec
    import orjson

    raw = orjson.dumps(BODY)
    if service_only:  # a tree before appliance/api/schemas/ existed (the hand-written checks)
        return {"service path (openai_fields)": _timed(_hand(raw), n, rounds), "body bytes": float(len(raw))}
    from appliance.api.schemas.openai import ChatRequest

    ns: dict[str, Any] = {}
    exec(compile(PYDANTIC_MODELS, "models", "exec", dont_inherit=True), ns)  # eager annotations
    pyd = ns["ChatRequest"]
    calls = {"service path (openai_fields)": _hand(raw),
             "orjson.loads + msgspec.convert": lambda: msgspec.convert(orjson.loads(raw), ChatRequest),
             "msgspec.json.decode(type=...)": lambda: msgspec.json.decode(raw, type=ChatRequest),
             "pydantic model_validate_json": lambda: pyd.model_validate_json(raw),
             "orjson.loads + pydantic model_validate": lambda: pyd.model_validate(orjson.loads(raw))}
    for call in calls.values():
        call()  # each must accept the body
    return {name: _timed(call, n, rounds) for name, call in calls.items()} | {"body bytes": float(len(raw))}


def memory(procs: int) -> dict[str, dict[str, float]]:
    out = {}
    for kind in ("msgspec", "pydantic"):
        runs = [json.loads(subprocess.run([sys.executable, "-c", MEMORY_PROBE, kind, json.dumps(BODY),
                                           PYDANTIC_MODELS], capture_output=True, text=True, check=True).stdout)
                for _ in range(procs)]
        out[kind] = {k: statistics.median(r[k] for r in runs) / 2**20 for k in ("rss", "uss")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=20000, help="calls per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--procs", type=int, default=3, help="fresh interpreters per memory figure")
    parser.add_argument("--service-only", action="store_true",
                        help="only the service path's figure (for a tree before the declarations: PYTHONPATH=it)")
    args = parser.parse_args()
    if args.service_only:
        print(json.dumps({"decode_us": decode(args.n, args.rounds, True)}, indent=1))
        return
    print(json.dumps({"decode_us": decode(args.n, args.rounds), "memory_mib": memory(args.procs)}, indent=1))


if __name__ == "__main__":
    main()
