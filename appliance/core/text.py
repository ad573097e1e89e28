"""Text around token streams: a version's vocabulary, its chat template, stop strings.

``Vocabulary`` (re-exported from appliance/core/tokenizer.py, beside the other tokenizers):
``assets/vocab.json`` of a token-level version, the tokenizer of the tiny character-level versions.

``ChatTemplate``: chat messages -> one prompt, by the version's own Jinja template
(``assets/chat_template.jinja``, else ``chat_template`` of ``assets/tokenizer_config.json``:
Hugging Face's conventions, rendered in Jinja's immutable sandbox as Hugging Face renders
them), else ``DEFAULT_CHAT_TEMPLATE``.

``StopText``: stop strings over a stream of text pieces, holding back what could still
become one. Pure functions of their inputs: no locks, no threads.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Mapping, Sequence

from appliance.core.errors import ApplianceError, InvalidArgument
from appliance.core.tokenizer import VOCAB_FILE, Vocabulary, check, find, special_text, tokenizer_config

CHAT_TEMPLATE_FILE = os.path.join("assets", "chat_template.jinja")
TOKENIZER_CONFIG_FILE = os.path.join("assets", "tokenizer_config.json")
# The template of a version that ships none: role tags on lines of their own; with tools,
# Hermes' convention (Qwen2.5's and NousResearch's templates): the functions listed as JSON in
# a system block, a call answered as <tool_call>{"name": ..., "arguments": {...}}</tool_call>,
# a tool's result as a "tool" message.
DEFAULT_CHAT_TEMPLATE = (
    "{% if tools %}<|system|>\nYou may call these functions. To call one, answer "
    "<tool_call>{\"name\": <name>, \"arguments\": <arguments>}</tool_call>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}{% endif %}"
    "{% for message in messages %}<|{{ message.role }}|>\n{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}<tool_call>{\"name\": {{ call.function.name | tojson }}, "
    "\"arguments\": {{ call.function.arguments | tojson }}}</tool_call>{% endfor %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


class ChatTemplate:
    """A chat prompt template (module docstring): ``render(messages)`` -> prompt text.
    Rendered in Jinja's immutable sandbox, as Hugging Face renders ``chat_template``."""

    def __init__(self, source: str, origin: str, bos: str = "", eos: str = ""):
        from jinja2 import TemplateError  # Flask's own dependency
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _template_error
        try:
            self.template = env.from_string(source)
        except TemplateError as exc:  # the version's template is broken: the server's fault, not the client's
            raise ApplianceError(f"the chat template of this version ({origin}) does not parse: {exc}") from exc
        self.origin, self.bos, self.eos = origin, bos, eos
        self.source = source
        # what a template may raise on messages it cannot take (Jinja's own errors included)
        self.refusals = (TemplateError, TypeError, ValueError, LookupError, AttributeError)

    @classmethod
    def load(cls, version_dir: str) -> "ChatTemplate":
        path = find(version_dir, "chat_template.jinja")
        if path is not None:
            with open(path, encoding="utf-8") as f:
                return cls(f.read(), CHAT_TEMPLATE_FILE)
        config = tokenizer_config(version_dir)
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the "default" one
            template = next((t.get("template") for t in template if isinstance(t, dict)
                             and t.get("name") == "default"), None)
        if isinstance(template, str):
            return cls(template, TOKENIZER_CONFIG_FILE, special_text(config.get("bos_token")),
                       special_text(config.get("eos_token")))
        return cls(DEFAULT_CHAT_TEMPLATE, "the default template")

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The prompt of ``messages``; ``tools`` (OpenAI's ``tools`` list) as Hugging Face
        passes them, the template's ``tools`` variable (None when there are none)."""
        try:
            return str(self.template.render(messages=list(messages), add_generation_prompt=True,
                                            bos_token=self.bos, eos_token=self.eos, tools=tools or None))
        except self.refusals as exc:  # the template refused these messages
            raise InvalidArgument(f"field 'messages': the chat template ({self.origin}) failed: {exc}") from exc

    def check(self) -> None:
        """Render a short conversation (with a tool call and its result): a template that fails
        on what every chat has is the version's fault, said when the version is first used
        for chat, not as a 500 on every request."""
        sample = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                  {"role": "assistant", "content": "a"}, {"role": "user", "content": "u"}]
        try:
            self.template.render(messages=sample, add_generation_prompt=True, bos_token=self.bos,
                                 eos_token=self.eos, tools=None)
        except InvalidArgument:
            pass  # raise_exception(...) on purpose (e.g. no system role): a refusal of content, not a fault
        except Exception as exc:
            raise ApplianceError(f"the chat template of this version ({self.origin}) fails on a plain chat: "
                                 f"{type(exc).__name__}: {exc}") from exc


def _template_error(message: str) -> None:
    raise InvalidArgument(f"field 'messages': {message}")


def check_assets(version_dir: str) -> None:
    """At load (appliance/core/manager.py): a version's vocabulary and chat template, where it
    ships them, must read, parse and render a plain chat; else the version is refused with the
    reason (``ApplianceError``), instead of a 500 on every chat request later."""
    try:
        check(version_dir)
    except (OSError, ValueError) as exc:
        raise ApplianceError(f"{VOCAB_FILE} of this version is not readable JSON: {exc}") from exc
    except InvalidArgument as exc:
        raise ApplianceError(exc.message) from exc
    ships = find(version_dir, "chat_template.jinja") is not None or \
        "chat_template" in tokenizer_config(version_dir)
    if ships:
        ChatTemplate.load(version_dir).check()


class StopText:
    """Stop strings over a text stream: ``feed(piece)`` -> (text that may be shown, stopped).
    Text that could still be the start of a stop string is held back until it cannot; the
    stop string itself and anything after it are never shown."""

    def __init__(self, stops: Iterable[str]):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.keep = max((len(s) for s in self.stops), default=1) - 1

    def feed(self, piece: str) -> tuple[str, bool]:
        text = self.held + piece
        if not self.stops:
            return text, False
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.held = ""
            return text[:cut], True
        safe = len(text)
        for size in range(min(self.keep, len(text)), 0, -1):  # the longest tail that begins a stop
            if any(s.startswith(text[-size:]) for s in self.stops):
                safe = len(text) - size
                break
        self.held = text[safe:]
        return text[:safe], False

    def flush(self) -> str:
        """What is held back when the stream ends without a stop string."""
        held, self.held = self.held, ""
        return held


__all__ = ["CHAT_TEMPLATE_FILE", "DEFAULT_CHAT_TEMPLATE", "VOCAB_FILE", "ChatTemplate", "StopText", "Vocabulary",
           "check_assets"]
