"""A tiny LiteRT LLM to try the OpenAI API with: ``models/chat/1`` ready to serve.

    .venv/bin/python scripts/tiny_chat_model.py [MODELS_DIR]     # default: ./models
    .venv/bin/appliance serve --models models

It builds a 2-layer TinyLlama with litert-torch's own builder (random weights, seeded: the
answers are gibberish, the API is real), converts it with litert-torch's converter (decode
batch 1, a 128-position cache), and writes ``assets/vocab.json`` (a character vocabulary:
token i is chr(i), so every ASCII text, JSON's characters included, encodes) and
``assets/chat_template.jinja`` (Hermes-style tool calls, short enough for 128 positions).
Needs the CPU torch wheel and litert-torch (``pip install torch==2.13.0 litert-torch==0.10.0``,
the test extra); about 20 s on two cores.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TEMPLATE = ("{% if tools %}{% for t in tools %}[{{ t.function.name }}]{% endfor %}{{ '\\n' }}{% endif %}"
            "{% for m in messages %}<{{ m.role }}>{{ m.content or '' }}{% for c in m.tool_calls or [] %}"
            "<tool_call>{\"name\": {{ c.function.name | tojson }}, \"arguments\": "
            "{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}{{ '\\n' }}{% endfor %}<assistant>")


def main(argv: list[str]) -> int:
    from tests.support import litert_llm  # litert-torch's builders, as the test suite converts them

    version = Path(argv[0] if argv else "models").resolve() / "chat" / "1"
    if (version / "model.tflite").exists():
        print(f"{version} exists already")
        return 0
    litert_llm.build_one(litert_llm.SPECS["lt_plain"], version)
    (version / "assets").mkdir(exist_ok=True)
    (version / "assets" / "vocab.json").write_text(json.dumps([chr(i) for i in range(litert_llm.VOCAB)]))
    (version / "assets" / "chat_template.jinja").write_text(TEMPLATE)
    print(f"built {version}: serve it with  appliance serve --models {version.parent.parent}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
