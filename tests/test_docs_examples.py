"""The OpenAI and generation docs' examples run as written (issue 38: "the docs' examples run
as written"; "the README's OpenAI section works as written from a fresh checkout").

Every fenced block of docs/openai.md, docs/generation.md and the README's OpenAI section is
run in order, in a scratch folder laid out like the checkout (``.venv`` and ``scripts`` linked
in, so ``models/`` is written there, never in the checkout): ``sh`` blocks line by line with
bash (``appliance serve`` started as the test's server, on a free port, waited for ready),
``python`` blocks with the venv's Python, a ``json`` block marked ``<!-- example body: POST
PATH -->`` posted to PATH. A block marked ``<!-- example not run: why -->`` is skipped; any
other block must run, so an example added to these pages is tried from then on. Only the
host and port are rewritten (``device.local`` and ``8501`` to the test server's).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.support.load import scaled
from tests.support.servers import ROOT, Server, free_port

pytest.importorskip("litert_torch", reason="scripts/tiny_chat_model.py converts with litert-torch (the test extra)")
pytest.importorskip("openai", reason="the docs' client is the official openai package (the test extra)")

PAGES = ("README.md", "docs/openai.md", "docs/generation.md")
BLOCK_RE = re.compile(r"(?:<!-- example (?P<mark>[^>]*?) -->\n)?```(?P<lang>\w*)\n(?P<code>.*?)```", re.S)
README_SECTION = ("**OpenAI-compatible API**", "Errors are ")


@dataclass
class Block:
    page: str
    lang: str
    code: str
    mark: str

    def __str__(self) -> str:
        return f"{self.page}: {self.lang} block {self.code.splitlines()[0][:60]!r}"


def blocks(page: str) -> list[Block]:
    text = (ROOT / page).read_text()
    if page == "README.md":  # its OpenAI section only: the rest of the README is tried elsewhere
        start = text.index(README_SECTION[0])
        text = text[start:text.index(README_SECTION[1], start)]
    return [Block(page, m["lang"], m["code"], m["mark"] or "") for m in BLOCK_RE.finditer(text)]


class Docs:
    """The scratch checkout, the one server the examples start, and how each block runs."""

    def __init__(self, work: Path):
        self.work, self.port, self.server = work, free_port(), None
        (work / ".venv").symlink_to(sys.prefix)  # the venv running the tests: the checkout's .venv
        (work / "scripts").symlink_to(ROOT / "scripts")
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def local(self, code: str) -> str:
        return code.replace("device.local", "127.0.0.1").replace("8501", str(self.port))

    def sh(self, block: Block) -> None:
        for line in self.local(block.code).replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if not line:
                continue
            if " serve " in line and "appliance" in line.split()[0]:
                self.serve(line)
                continue
            done = subprocess.run(["bash", "-c", line], cwd=self.work, env=self.env, capture_output=True,
                                  text=True, timeout=scaled(900))
            assert done.returncode == 0, f"{block}: `{line}` failed:\n{done.stdout}\n{done.stderr}"
            assert '"error"' not in done.stdout and "event: error" not in done.stdout, f"{block}: {done.stdout}"

    def serve(self, line: str) -> None:
        """``appliance serve ...`` as written, on the test's port and a scratch state folder."""
        if self.server is not None:  # the README and openai.md start the same server
            return
        args = shlex.split(line) + ["--port", str(self.port), "--host", "127.0.0.1", "--state",
                                    str(self.work / "state"), "--no-discovery", "--grpc-port", "0"]
        log = self.work / "server.log"
        with open(log, "wb") as out:  # started where the commands run: ``--models models`` is the scratch one
            proc = subprocess.Popen(args, cwd=self.work, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        self.server = Server(proc, self.port, self.work / "state", log)
        server = self.server
        server.wait_for(lambda: server.get("/readyz", timeout=5).status_code == 200, 180,
                        "the documented server to be ready")

    def python(self, block: Block) -> str:
        done = subprocess.run([str(self.work / ".venv" / "bin" / "python"), "-c", self.local(block.code)],
                              cwd=self.work, env=self.env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{block} failed:\n{done.stdout}\n{done.stderr}"
        return done.stdout

    def body(self, block: Block) -> None:
        path = block.mark.removeprefix("body: POST ").strip()
        answer = requests.post(f"http://127.0.0.1:{self.port}{path}", data=block.code, timeout=120)
        assert answer.status_code == 200 and "event: error" not in answer.text, f"{block}: {answer.text}"
        assert "event: done" in answer.text or '"finish_reason"' in answer.text, f"{block}: {answer.text}"


@pytest.fixture
def docs(tmp_path: Path) -> Any:
    d = Docs(tmp_path)
    yield d
    if d.server is not None:
        d.server.stop()


@pytest.mark.timeout(1800)  # a documented pip install may take 900 s (stretched like this timeout)
def test_the_docs_examples_run_as_written(docs: Docs) -> None:
    ran = []
    for page in PAGES:
        for block in blocks(page):
            if block.mark.startswith("not run"):
                continue
            if block.lang == "sh":
                docs.sh(block)
            elif block.lang == "python":
                out = docs.python(block)
                assert out.strip(), f"{block} printed nothing"
            elif block.lang == "json" and block.mark.startswith("body: POST "):
                docs.body(block)
            else:
                pytest.fail(f"{block}: neither runnable nor marked '<!-- example not run: why -->'")
            ran.append(str(block))
    assert docs.server is not None, "no example started the server"
    assert sum(p.startswith("README.md") for p in ran) == 2 and len(ran) >= 6, ran
