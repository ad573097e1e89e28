"""openai-python's own examples (tests/peers/openai/, vendored unchanged) run as scripts against
the real ``appliance serve``: only the environment points them at it (``OPENAI_BASE_URL``,
``OPENAI_API_KEY``); the server serves the model names they ask for, as copies of the
conversion with a real byte-level BPE tokenizer.json (tests/support/real_tokenizers.py)."""

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


@pytest.mark.parametrize("example, expect", [
    ("streaming.py", ['"object": "text_completion"', '"finish_reason": "length"', '"model": "gpt-3.5-turbo-instruct:1"']),
    ("demo.py", ["----- standard request -----", "----- streaming request -----", "----- custom response headers"]),
])
def test_an_example_runs_unchanged(server: Server, example: str, expect: list[str], tmp_path: Path) -> None:
    env = {**os.environ, "OPENAI_BASE_URL": server.url + "/v1", "OPENAI_API_KEY": "unused"}
    done = subprocess.run([sys.executable, str(EXAMPLES / example)], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for text in expect:
        assert text in done.stdout, done.stdout[-3000:]
