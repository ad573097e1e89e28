"""Structured outputs and tool calls of the OpenAI API: the grammar a request asks for, and
the tool calls found in a finished answer.

**response_format**: ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``
constrains the text to a JSON document valid against ``schema``; ``{"type": "json_object"}``
to any JSON object; ``{"type": "text"}`` to nothing. Compact JSON (appliance/core/constraints.py).

**Tools** (``tools`` + ``tool_choice``): the tools go to the version's chat template as
Hugging Face passes them (the ``tools`` variable). Two call formats are recognised, the ones
the templates we ship or test write:

* ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen2.5,
  NousResearch Hermes, and DEFAULT_CHAT_TEMPLATE in appliance/core/text.py): a template whose
  source mentions ``<tool_call>``;
* ``json``: a bare JSON object ``{"name": ..., "parameters": {...}}`` (Llama 3.1/3.2's
  templates; ``"arguments"`` is read too): any other template.

``tool_choice`` ``none``: the tools are shown, the answer is text. ``auto`` (the default
with tools): free decoding, then the answer is read as calls when it is one in the format
(else it is text). ``required`` / ``{"type": "function", "function": {"name": N}}``: the
answer is constrained to a call in the format, its arguments to the function's
``parameters`` schema (``required``: any of the tools). Pure functions, no state.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from appliance.api.openai_fields import FieldError
from appliance.core.constraints import ANY_OBJECT, JSON_OPTIONS, Grammar

HERMES, BARE = "hermes", "json"
HERMES_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def response_grammar(body: dict[str, Any]) -> Grammar | None:
    """The grammar of ``response_format`` (module docstring); None for text."""
    spec = body.get("response_format")
    if spec is None:
        return None
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar.json_schema(ANY_OBJECT, "response_format json_object")
    if kind != "json_schema":
        raise FieldError("field 'response_format' must be {\"type\": \"text\" | \"json_object\" | \"json_schema\"}",
                         "response_format")
    inner = spec.get("json_schema")
    schema = inner.get("schema") if isinstance(inner, dict) else None
    if not isinstance(schema, dict):
        raise FieldError("field 'response_format': json_schema needs a 'schema' object", "response_format")
    return Grammar.json_schema(schema, f"field 'response_format': schema '{inner.get('name', '')}'")


@dataclass(frozen=True)
class Tools:
    """The request's tools and choice: ``tools`` (OpenAI's list), ``choice`` (none | auto |
    required | a function's name), ``style`` (hermes | json) and its arguments key."""

    tools: list[dict[str, Any]]
    choice: str
    forced: str | None  # the one function a named tool_choice forces
    style: str
    arguments_key: str

    @property
    def reads_calls(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    def grammar(self) -> Grammar | None:
        """The call grammar for ``required`` or a named function; None otherwise."""
        if self.choice not in ("required", "named"):
            return None
        calls = [self._call_schema(t["function"]) for t in self.tools
                 if self.forced is None or t["function"]["name"] == self.forced]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        body = json.dumps({**schema, "x-guidance": JSON_OPTIONS})  # compact, as response_format's
        lark = f'start: "<tool_call>" call "</tool_call>"\ncall: %json {body}' if self.style == HERMES else \
            f"start: call\ncall: %json {body}"
        return Grammar.lark(lark, "field 'tools'")

    def _call_schema(self, function: dict[str, Any]) -> dict[str, Any]:
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        return {"type": "object", "properties": {"name": {"const": function["name"]},
                                                 self.arguments_key: parameters},
                "required": ["name", self.arguments_key], "additionalProperties": False}

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """OpenAI's ``tool_calls`` read from a finished answer; None: the answer is text."""
        if not self.reads_calls:
            return None
        found = [_json(block) for block in HERMES_RE.findall(text)] if self.style == HERMES else [_json(text)]
        names = {t["function"]["name"] for t in self.tools}
        calls = []
        for call in found:
            arguments = call.get("arguments", call.get("parameters")) if isinstance(call, dict) else None
            if not isinstance(call, dict) or call.get("name") not in names or not isinstance(arguments, dict):
                return None
            calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                          "function": {"name": call["name"], "arguments": json.dumps(arguments)}})
        return calls or None


def _json(text: str) -> Any:
    try:
        return orjson.loads(text.strip())
    except orjson.JSONDecodeError:
        return None


def read_tools(body: dict[str, Any], template_source: str) -> Tools | None:
    tools = body.get("tools")
    if not tools:
        if body.get("tool_choice") not in (None, "none", "auto"):
            raise FieldError("field 'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list) or not all(_is_function(t) for t in tools):
        raise FieldError("field 'tools' must be a list of {\"type\": \"function\", \"function\": {\"name\", "
                         "\"parameters\"}}", "tools")
    choice, forced = _choice(body.get("tool_choice"), {t["function"]["name"] for t in tools})
    style = HERMES if "<tool_call>" in template_source else BARE
    key = "parameters" if style == BARE and "parameters" in template_source else "arguments"
    return Tools(tools, choice, forced, style, key)


def _is_function(tool: Any) -> bool:
    function = tool.get("function") if isinstance(tool, dict) else None
    return isinstance(tool, dict) and tool.get("type") == "function" and isinstance(function, dict) and \
        isinstance(function.get("name"), str) and isinstance(function.get("parameters", {}), dict)


def _choice(choice: Any, names: set[str]) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if choice in ("none", "auto", "required"):
        return choice, None
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str) or name not in names:
        raise FieldError(f"field 'tool_choice': {choice!r} is not none, auto, required or "
                         "{\"type\": \"function\", \"function\": {\"name\": <one of the tools>}}", "tool_choice")
    return "named", name


__all__ = ["Tools", "read_tools", "response_grammar"]
