"""openai-python's own examples (tests/peers/openai/, vendored unchanged) run as scripts against
the real ``appliance serve``: only the environment points them at it (``OPENAI_BASE_URL``,
``OPENAI_API_KEY``); the server serves the model names they ask for: ``streaming.py``,
``demo.py`` and ``async_demo.py`` a conversion with a real byte-level BPE tokenizer.json
(tests/support/real_tokenizers.py); ``parsing*.py`` (structured outputs, tools left to the model)
a tiny model trained to answer them, with a Hugging Face tokenizer.json
(tests/support/example_chat.py: random weights never decide to call a tool)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from tests.support import real_tokenizers
from tests.support.servers import Server, launch

# Its waits (a server that builds or converts its model first, a burst) reach past the default
# 300 s: the pytest timeout sits above every wait inside it (tests/test_timeouts.py).
pytestmark = pytest.mark.timeout(900)

pytest.importorskip("openai", reason="the official OpenAI client (the test extra)")
pytest.importorskip("litert_torch", reason="litert-torch converts the model (the test extra)")
pytest.importorskip("tokenizers", reason="Hugging Face tokenizers reads tokenizer.json")

EXAMPLES = Path(__file__).resolve().parents[1] / "peers" / "openai"
NAMES = ("gpt-3.5-turbo-instruct", "gpt-5.5")  # what the examples ask for


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("examples")
    for name in NAMES:
        shutil.copytree(real_tokenizers.versions() / "tok_bpe", root / "models" / name)
    srv = launch(["--models", str(root / "models")], root)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def parsing_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from tests.support import example_chat

    root = tmp_path_factory.mktemp("parsing")
    shutil.copytree(example_chat.version_dir(), root / "models" / PARSING_MODEL / "1")
    srv = launch(["--models", str(root / "models")], root)
    yield srv
    srv.stop()


PARSING_MODEL = "gpt-4o-2024-08-06"  # what every parsing*.py asks for


def run_example(server: Server, example: str, tmp_path: Path) -> str:
    """The example's stdout; it must exit 0 (an example raises on what it cannot parse)."""
    env = {**os.environ, "OPENAI_BASE_URL": server.url + "/v1", "OPENAI_API_KEY": "unused"}
    done = subprocess.run([sys.executable, str(EXAMPLES / example)], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize("example, expect", [
    ("streaming.py", ['"object": "text_completion"', '"finish_reason": "length"', '"model": "gpt-3.5-turbo-instruct:1"']),
    ("demo.py", ["----- standard request -----", "----- streaming request -----", "----- custom response headers"]),
    ("async_demo.py", ["\n"]),
])
def test_an_example_runs_unchanged(server: Server, example: str, expect: list[str], tmp_path: Path) -> None:
    out = run_example(server, example, tmp_path)
    for text in expect:
        assert text in out, out[-3000:]


@pytest.mark.parametrize("example, expect", [
    # message.parsed is a MathResponse: its steps printed, then its final answer
    ("parsing.py", ["answer:  x = -29/8", "Step("]),
    # content deltas, then content.done with the parsed document, then the whole completion
    ("parsing_stream.py", ['{"steps":[{"explanation":', "answer: x = -29/8", "---------------",
                           "ParsedChatCompletion"]),
    # the example itself asserts parsed_arguments is its Query (enums, a Union with a nested model)
    ("parsing_tools.py", ["Table.orders", "parsed_arguments=Query("]),
    # two parallel calls, each streamed as argument deltas and closed by a done event
    ("parsing_tools_stream.py", ["tool_calls.function.arguments.delta", "tool_calls.function.arguments.done",
                                 "San Francisco", "New York", "finish_reason='tool_calls'"]),
])
def test_a_parsing_example_runs_unchanged(parsing_server: Server, example: str, expect: list[str],
                                          tmp_path: Path) -> None:
    out = run_example(parsing_server, example, tmp_path)
    for text in expect:
        assert text in out, out[-3000:]
