"""A tiny LiteRT LLM to try the OpenAI API with: ``models/chat/1`` ready to serve.

    .venv/bin/python scripts/tiny_chat_model.py [MODELS_DIR]            # default: ./models
    .venv/bin/appliance serve --models models
    .venv/bin/python scripts/tiny_chat_model.py --build [MODELS_DIR]    # convert it again (the test extra)

By default it copies the prebuilt model shipped beside this script (scripts/tiny_chat/: 377 KiB),
so it works in the venv scripts/run.sh makes: no torch, no TensorFlow. That model is a 2-layer
TinyLlama built with litert-torch's own builder (random weights, seeded: the answers are
gibberish, the API is real), converted with litert-torch's converter (decode batch 1, a
128-position cache), with ``assets/tokenizer.json`` (a Hugging Face ``tokenizers`` file: a
character vocabulary, token i is chr(i), so every ASCII text, JSON's characters included,
encodes; no merges, pieces fused on decode), the same vocabulary as ``assets/vocab.json``, and
``assets/chat_template.jinja`` (Hermes-style tool calls, short enough for 128 positions).

``--build`` converts it again, as the shipped copy was made: it needs the CPU torch wheel and
litert-torch (``pip install torch==2.13.0 litert-torch==0.10.0``, the test extra) and the
``tokenizers`` package; about 20 s on two quiet cores. To refresh the shipped copy:
``--build /tmp/x`` then copy ``/tmp/x/chat/1/`` over scripts/tiny_chat/.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PREBUILT = Path(__file__).resolve().parent / "tiny_chat"

TEMPLATE = ("{% if tools %}{% for t in tools %}[{{ t.function.name }}]{% endfor %}{{ '\\n' }}{% endif %}"
            "{% for m in messages %}<{{ m.role }}>{{ m.content or '' }}{% for c in m.tool_calls or [] %}"
            "<tool_call>{\"name\": {{ c.function.name | tojson }}, \"arguments\": "
            "{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}{{ '\\n' }}{% endfor %}<assistant>")


def build(version: Path) -> None:
    """Convert the model with litert-torch and write its assets (module docstring)."""
    from tests.support import litert_llm  # litert-torch's builders, as the test suite converts them

    litert_llm.build_one(litert_llm.SPECS["lt_plain"], version)
    assets = version / "assets"
    assets.mkdir(exist_ok=True)
    tokens = [chr(i) for i in range(litert_llm.VOCAB)]
    (assets / "vocab.json").write_text(json.dumps(tokens))
    (assets / "chat_template.jinja").write_text(TEMPLATE)
    write_tokenizer(tokens, assets / "tokenizer.json")


def write_tokenizer(tokens: list[str], path: Path) -> None:
    """``tokens`` as a Hugging Face tokenizer: BPE without merges over single characters (each
    character its own token, as vocab.json), pieces fused back into text on decode."""
    from tokenizers import Tokenizer, decoders, models

    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
    tokenizer.decoder = decoders.Fuse()
    tokenizer.save(str(path))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="Write models/chat/1, a tiny LiteRT LLM (module docstring).")
    parser.add_argument("models", nargs="?", default="models", help="the model base directory (default: %(default)s)")
    parser.add_argument("--build", action="store_true", help="convert it with litert-torch instead of copying "
                                                             "the prebuilt one (needs the test extra)")
    args = parser.parse_args(argv)
    version = Path(args.models).resolve() / "chat" / "1"
    if (version / "model.tflite").exists():
        print(f"{version} exists already")
        return 0
    if args.build:
        build(version)
    else:
        shutil.copytree(PREBUILT, version)
    print(f"{'built' if args.build else 'wrote'} {version}: serve it with  appliance serve --models {version.parent.parent}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
