"""Other OpenAI clients against a running appliance: LiteLLM and langchain-openai (issue 35).

Both conflict with the test extra's pins (litert-torch's xdsl needs typing-extensions < 4.13,
LiteLLM >= 4.13; langchain-openai with torch's), so they run from a small venv of their own:

    python3 -m venv /tmp/peers && /tmp/peers/bin/pip install litellm langchain-openai
    .venv/bin/python scripts/tiny_chat_model.py models && .venv/bin/appliance serve --models models &
    /tmp/peers/bin/python scripts/peer_clients.py http://127.0.0.1:8501/v1 chat

Checks, each printed with PASS or FAIL: LiteLLM's completion answers and raises
``ContextWindowExceededError`` for a prompt over the context (it matches OpenAI's words);
langchain-openai's ``ChatOpenAI.with_structured_output`` returns a valid object and
``bind_tools`` with a forced tool returns a call whose arguments fit its schema.
Exit status 1 when any check fails.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Literal

RESULTS: list[bool] = []


def check(name: str, fn: Callable[[], Any]) -> None:
    try:
        detail = fn()
        RESULTS.append(True)
        print(f"PASS {name}: {detail}")
    except Exception as exc:  # a report of every check, not the first failure
        RESULTS.append(False)
        print(f"FAIL {name}: {type(exc).__name__}: {exc}")


def litellm_checks(base: str, model: str) -> None:
    import litellm

    def answers() -> str:
        out = litellm.completion(model=f"openai/{model}", api_base=base, api_key="unused", max_tokens=4,
                                 messages=[{"role": "user", "content": "hi"}])
        return repr(out.choices[0].message.content)

    def context() -> str:
        try:
            litellm.completion(model=f"openai/{model}", api_base=base, api_key="unused", max_tokens=4,
                               messages=[{"role": "user", "content": "x" * 400}])
        except litellm.ContextWindowExceededError as exc:
            return f"ContextWindowExceededError ({str(exc)[:80]}...)"
        raise AssertionError("no ContextWindowExceededError")

    check("litellm completion", answers)
    check("litellm ContextWindowExceededError", context)


def langchain_checks(base: str, model: str) -> None:
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    class Answer(BaseModel):
        answer: Literal["yes", "no"]
        count: int

    # a character vocabulary: a call and its arguments take ~80 tokens
    llm = ChatOpenAI(model=model, base_url=base, api_key="unused", max_tokens=120, temperature=0)

    def structured() -> str:
        return repr(llm.with_structured_output(Answer, strict=True).invoke("is it so?"))

    def weather(city: Literal["Paris", "Oslo"], unit: Literal["C", "F"]) -> str:
        """The weather in a city."""
        return "sunny"

    def tools() -> str:
        message = llm.bind_tools([weather], tool_choice="weather").invoke("weather?")
        call = message.tool_calls[0]
        assert call["name"] == "weather" and call["args"]["city"] in ("Paris", "Oslo"), call
        return repr(call)

    check("langchain with_structured_output", structured)
    check("langchain bind_tools (forced)", tools)


def main(argv: list[str]) -> int:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # offline: no fetch of LiteLLM's price list
    base = argv[0] if argv else "http://127.0.0.1:8501/v1"
    model = argv[1] if len(argv) > 1 else "chat"
    litellm_checks(base, model)
    langchain_checks(base, model)
    return 0 if all(RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
