"""Text around token streams (appliance/core/text.py): stop strings cut across pieces, chat
templates found where Hugging Face puts them, their refusals answered as the client's
mistake and a broken template as the version's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from appliance.core.errors import ApplianceError, InvalidArgument
from appliance.core.text import DEFAULT_CHAT_TEMPLATE, ChatTemplate, StopText, Vocabulary

HF_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}"
               "{{ raise_exception('System role not supported') }}{% endif %}"
               "[{{ m.role }}] {{ m.content }}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")


def shown(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    cut, text = StopText(stops), ""
    for piece in pieces:
        out, stopped = cut.feed(piece)
        text += out
        if stopped:
            return text, True
    return text + cut.flush(), False


@pytest.mark.parametrize(("stops", "pieces", "want"), [
    ([], ["ab", "c"], ("abc", False)),
    (["c"], ["ab", "cd"], ("ab", True)),
    (["xyz"], ["1x", "y", "zq"], ("1", True)),  # a stop string across three pieces
    (["xyz"], ["1x", "y", "!"], ("1xy!", False)),  # held back, then shown when it cannot be one
    (["xyz"], ["1x", "y"], ("1xy", False)),  # held back at the end: flushed
    (["bc", "abd"], ["a", "b", "c"], ("a", True)),  # the earliest stop wins
])
def test_stop_strings(stops: list[str], pieces: list[str], want: tuple[str, bool]) -> None:
    assert shown(stops, pieces) == want


def test_a_version_without_a_template_gets_the_default(tmp_path: Path) -> None:
    template = ChatTemplate.load(str(tmp_path))
    assert template.origin == "the default template"
    assert template.render([{"role": "user", "content": "hi"}]) == "<|user|>\nhi\n<|assistant|>\n"
    assert ChatTemplate(DEFAULT_CHAT_TEMPLATE, "x").render([]) == "<|assistant|>\n"


def test_hugging_faces_tokenizer_config_and_its_named_templates(tmp_path: Path) -> None:
    assets = tmp_path / "assets"
    assets.mkdir()
    config = {"bos_token": {"content": "<s>"}, "eos_token": "</s>",
              "chat_template": [{"name": "tool_use", "template": "no"}, {"name": "default", "template": HF_TEMPLATE}]}
    (assets / "tokenizer_config.json").write_text(json.dumps(config))
    template = ChatTemplate.load(str(tmp_path))
    assert template.render([{"role": "user", "content": "hi"}]) == "<s>[user] hi</s>[assistant]"
    with pytest.raises(InvalidArgument, match="field 'messages': System role not supported"):
        template.render([{"role": "system", "content": "x"}])
    (assets / "chat_template.jinja").write_text("{{ messages | length }}")  # the file wins over the config
    assert ChatTemplate.load(str(tmp_path)).render([{"role": "user", "content": "a"}] * 3) == "3"


def test_a_broken_template_is_the_versions_fault(tmp_path: Path) -> None:
    (tmp_path / "assets").mkdir()
    (tmp_path / "assets" / "chat_template.jinja").write_text("{% for %}")
    with pytest.raises(ApplianceError, match="chat_template.jinja.*does not parse") as broken:
        ChatTemplate.load(str(tmp_path))
    assert broken.value.http_status == 500
    with pytest.raises(InvalidArgument, match="chat template"):  # the sandbox refuses, the client is told
        ChatTemplate("{{ messages.__class__.__mro__ }}{{ ''.__class__.mro() }}", "x").render([])


def test_a_character_vocabulary_round_trips(tmp_path: Path) -> None:
    vocab = Vocabulary(["a", "b", "ab", " "])
    assert vocab.encode("ab a") == [2, 3, 0]  # greedy longest match
    assert "".join(map(vocab.decode, vocab.encode("ab a"))) == "ab a"
    with pytest.raises(InvalidArgument, match="'z' at offset 1"):
        vocab.encode("az")
