"""Text around token streams (appliance/core/text.py): stop strings cut across pieces, chat
templates found where Hugging Face puts them, their refusals answered as the client's
mistake and a broken template as the version's: refused when the version loads (a real
server), the last good version serving on."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from appliance.core.errors import ApplianceError, InvalidArgument
from appliance.core.text import DEFAULT_CHAT_TEMPLATE, ChatTemplate, StopText, Vocabulary
from tests.api.test_generate import gen_models  # noqa: F401  (the session fixture)

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


# -- at load: a version whose vocabulary or template is broken is refused with the reason ----------
BROKEN = {
    "does not parse": ("chat_template.jinja", "{% for m in messages %}{{ m.content }"),
    "fails on a plain chat": ("chat_template.jinja", "{{ messages[0].content.upper(1, 2, 3) }}"),
    "vocab.json of this version is not a JSON list of strings": ("vocab.json", '{"a": 1}'),
}


def test_a_broken_version_is_refused_at_load_and_the_last_good_one_serves(start_server: Any, gen_models: Path,
                                                                          tmp_path: Path) -> None:
    """Before, a broken template showed only as a 500 on every chat request once the version
    served. Now each broken version is quarantined at load naming its fault; v1 keeps serving."""
    base = tmp_path / "models" / "chat"
    shutil.copytree(gen_models / "gen_tflite" / "1", base / "1")
    config = tmp_path / "appliance.toml"
    config.write_text(f'poll_interval_s = 0.2\n[[models]]\nname = "chat"\nbase_path = "{base}"\n')
    srv = start_server("--config", str(config))
    for version, (reason, (name, text)) in enumerate(BROKEN.items(), start=2):
        staged = tmp_path / f"staged-{version}"
        shutil.copytree(gen_models / "gen_tflite" / "1", staged)
        (staged / "assets" / name).write_text(text)
        os.rename(staged, base / str(version))  # appears whole
        why = srv.wait_for(lambda: srv.status()["models"]["chat"]["quarantined"].get(str(version)), 60,
                           f"version {version} to be refused")
        assert reason in why, why
        assert srv.status()["models"]["chat"]["serving_version"] == 1
    answer = srv.post("/v1/completions", {"model": "chat", "max_tokens": 3, "prompt": "the model "})
    assert answer.status_code == 200 and answer.json()["model"] == "chat:1", answer.text
