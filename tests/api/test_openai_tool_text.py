"""Tool calls as text (appliance/api/openai_tools.py): the arguments handed over as generated
(an integer past 64 bits, non-ASCII, the model's own spacing), a cut call read as OpenAI reports
it, and function schemas with ``$defs``/``$ref`` moved where the call's grammar resolves them."""

from __future__ import annotations

import json

import pytest

from appliance.api.openai_tools import Tools

FUNCTION = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"t": {"$ref": "#/$defs/Table"}, "n": {"$ref": "#/definitions/Nested"}},
    "required": ["t", "n"], "$defs": {"Table": {"enum": ["a", "b"]}},
    "definitions": {"Nested": {"type": "object", "properties": {"x": {"$ref": "#/$defs/Table"}}}}}}}


def tools(choice: str = "auto", forced: str | None = None, style: str = "hermes") -> Tools:
    return Tools([FUNCTION], choice, forced, style, "arguments")


def test_arguments_are_passed_through_as_generated() -> None:
    text = '<tool_call>{"name": "f", "arguments": {"id": 123456789012345678901234567890, "s": "é"}}</tool_call>'
    calls = tools().calls(text)
    assert calls is not None
    assert calls[0]["function"]["arguments"] == '{"id": 123456789012345678901234567890, "s": "é"}'
    bare = tools(style="json").calls('{"arguments":{"v":[1, 2]},"name":"f"}')
    assert bare is not None and bare[0]["function"]["arguments"] == '{"v":[1, 2]}'


@pytest.mark.parametrize("text", ['<tool_call>{"name": "g", "arguments": {}}</tool_call>', "plain text",
                                  '<tool_call>{"name": "f", "arguments": {}} trailing</tool_call>'])
def test_text_that_is_no_call_of_these_tools_stays_text(text: str) -> None:
    assert tools().calls(text) is None


def test_a_cut_call_is_the_call_so_far() -> None:
    cut = tools("named", "f").cut_call('<tool_call>{"name": "f", "arguments": {"t": "a", "n"')
    assert cut is not None and cut[0]["function"] == {"name": "f", "arguments": '{"t": "a", "n"'}
    early = tools("named", "f").cut_call('<tool_call>{"na')
    assert early is not None and early[0]["function"] == {"name": "f", "arguments": ""}
    assert tools().cut_call("Hello") is None


def test_defs_and_refs_resolve_from_the_calls_root() -> None:
    schema = tools("named", "f").grammar_schema()
    defs = schema["$defs"]
    arguments = schema["properties"]["arguments"]
    assert arguments["properties"]["t"] == {"$ref": "#/$defs/f.Table"}
    assert arguments["properties"]["n"] == {"$ref": "#/$defs/f.Nested"}
    assert defs["f.Nested"]["properties"]["x"] == {"$ref": "#/$defs/f.Table"}
    refs = [r for r in json.dumps(schema).split('"$ref": "')[1:]]
    for ref in refs:  # every ref points at a definition that exists
        assert ref.split('"')[0].removeprefix("#/$defs/") in defs


def test_the_grammar_engine_takes_the_call_schema() -> None:
    pytest.importorskip("llguidance")
    grammar = tools("named", "f").grammar()
    assert grammar is not None
    from appliance.core.constraints import TokenTable
    from appliance.core.text import Vocabulary

    table = TokenTable.of(Vocabulary([chr(i) for i in range(32, 127)] + ["<eos>"], eos="<eos>"))
    assert grammar.check(table) is grammar  # before the fix: "Pointer '/$defs/Table' does not exist"
