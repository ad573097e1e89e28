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
        body = json.dumps({**self.grammar_schema(), "x-guidance": JSON_OPTIONS})  # compact, as response_format's
        lark = f'start: "<tool_call>" call "</tool_call>"\ncall: %json {body}' if self.style == HERMES else \
            f"start: call\ncall: %json {body}"
        return Grammar.lark(lark, "field 'tools'")

    def _call_schema(self, function: dict[str, Any]) -> dict[str, Any]:
        """The call object's schema, the function's parameters inside it. Their ``$defs`` (and
        ``definitions``) move to the call's root, renamed per function, and every ``$ref`` to them
        (or to the parameters' own root, "#") follows: a ref resolves from the document root,
        which is now the call (pydantic writes enums and nested models as such refs)."""
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        parameters, defs = _rebase(parameters, f"{function['name']}.")
        schema: dict[str, Any] = {"type": "object", "properties": {"name": {"const": function["name"]},
                                                                   self.arguments_key: parameters},
                                  "required": ["name", self.arguments_key], "additionalProperties": False}
        return {**schema, "$defs": defs} if defs else schema

    def grammar_schema(self) -> dict[str, Any]:
        calls = [self._call_schema(t["function"]) for t in self.tools
                 if self.forced is None or t["function"]["name"] == self.forced]
        if len(calls) == 1:
            return calls[0]
        defs = {k: v for call in calls for k, v in call.pop("$defs", {}).items()}
        return {"anyOf": calls, **({"$defs": defs} if defs else {})}

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """OpenAI's ``tool_calls`` read from a finished answer; None: the answer is text. The
        arguments are the generated text of the arguments object, as it was generated (never
        parsed and re-encoded: an integer past 64 bits stays what it is)."""
        if not self.reads_calls:
            return None
        found = [_call(block) for block in HERMES_RE.findall(text)] if self.style == HERMES else [_call(text)]
        names = {t["function"]["name"] for t in self.tools}
        calls = []
        for call in found:
            if call is None or call[0] not in names:
                return None
            calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                          "function": {"name": call[0], "arguments": call[1]}})
        return calls or None

    def may_be_call(self, text: str) -> bool:
        """Whether a streamed answer's text so far may still be a call (then it is held back)."""
        start = text.lstrip()
        marker = "<tool_call>" if self.style == HERMES else "{"
        return marker.startswith(start) or start.startswith(marker)

    def cut_call(self, text: str) -> list[dict[str, Any]] | None:
        """A call the length limit cut (OpenAI: finish_reason ``length``, the call so far, its
        arguments unfinished); None when the text is no call's beginning."""
        if not self.reads_calls:
            return None
        body = text.strip()
        if self.style == HERMES:
            if not body.startswith("<tool_call>"):
                return None
            body = body[len("<tool_call>"):].strip()
        found = CUT_RE.match(body)
        if not body.startswith("{") or (found is None and self.forced is None):
            return None
        name = found.group(1) if found is not None else self.forced
        arguments = body[found.end():] if found is not None and found.group(2) is not None else ""
        return [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                 "function": {"name": name, "arguments": arguments}}]


CUT_RE = re.compile(r'\{\s*"name"\s*:\s*"([^"\\]+)"\s*(,\s*"(?:arguments|parameters)"\s*:\s*)?')


def _rebase(schema: dict[str, Any], prefix: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the schema without its definitions, its definitions renamed) with refs rewritten."""
    schema = dict(schema)
    defs = {**schema.pop("definitions", {}), **schema.pop("$defs", {})}
    if not defs and not _has_ref(schema):
        return schema, {}
    renamed = {prefix + k: v for k, v in defs.items()}
    refers_root = _has_ref(schema, "#") or _has_ref(defs, "#")
    if refers_root:  # a recursive schema: its own root becomes a definition too
        renamed[prefix + "$root"] = schema
    fixed = {k: _refs(v, prefix) for k, v in renamed.items()}
    return (_refs(schema, prefix) if not refers_root else {"$ref": f"#/$defs/{prefix}$root"}), fixed


def _refs(node: Any, prefix: str) -> Any:
    if isinstance(node, list):
        return [_refs(v, prefix) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _refs(v, prefix) for k, v in node.items()}
    ref = node.get("$ref")
    if isinstance(ref, str):
        for root in ("#/$defs/", "#/definitions/"):
            if ref.startswith(root):
                out["$ref"] = f"#/$defs/{prefix}{ref[len(root):]}"
        if ref == "#":
            out["$ref"] = f"#/$defs/{prefix}$root"
    return out


def _has_ref(node: Any, exact: str | None = None) -> bool:
    if isinstance(node, list):
        return any(_has_ref(v, exact) for v in node)
    if not isinstance(node, dict):
        return False
    ref = node.get("$ref")
    if isinstance(ref, str) and (exact is None or ref == exact):
        return True
    return any(_has_ref(v, exact) for v in node.values())


def _call(text: str) -> tuple[str, str] | None:
    """(name, the arguments' text as generated) of one call object, or None: the object is
    walked with the standard library's decoder, which gives each value's span."""
    decoder, data = json.JSONDecoder(), text.strip()
    name, arguments, i = None, None, _skip(data, 0, "{")
    try:
        while i is not None and i < len(data) and data[i] != "}":
            key, i = decoder.raw_decode(data, i)
            start = _skip(data, i, ":")
            if start is None:
                return None
            value, end = decoder.raw_decode(data, start)
            if key == "name" and isinstance(value, str):
                name = value
            elif key in ("arguments", "parameters") and isinstance(value, dict):
                arguments = data[start:end]
            i = _skip(data, end, ",") if _skip(data, end, ",") is not None else _ws(data, end)
    except json.JSONDecodeError:
        return None
    if i is None or i >= len(data) or data[i] != "}" or data[i + 1:].strip() or name is None or arguments is None:
        return None
    return name, arguments


def _ws(data: str, i: int) -> int:
    while i < len(data) and data[i] in " \t\r\n":
        i += 1
    return i


def _skip(data: str, i: int, char: str) -> int | None:
    """The index after ``char`` (whitespace around it skipped), or None when it is not next."""
    i = _ws(data, i)
    return _ws(data, i + 1) if i < len(data) and data[i] == char else None


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
