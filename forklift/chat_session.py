"""The interactive `forklift chat` loop: tokens are printed as the engine produces them."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TextIO

from forklift.config import EngineConfig
from forklift.engine.engine import LLMEngine
from forklift.sampling_params import SamplingParams

HELP = "Type a message and press Enter. /reset clears the conversation, /exit quits."


def stream_reply(
    engine: LLMEngine, messages: list[dict[str, str]], params: SamplingParams, out: TextIO
) -> str:
    """Run one chat turn, writing text deltas to `out` as they arrive; returns the reply."""
    tokenizer = engine.tokenizer
    assert tokenizer is not None
    ids = tokenizer.encode_chat(messages)
    request_id = engine.add_request(None, {"prompt_token_ids": ids}, params)
    shown = ""
    try:
        while True:
            for output in engine.step():
                if output.request_id != request_id:
                    continue
                text = output.outputs[0].text
                out.write(text[len(shown) :])
                out.flush()
                shown = text
                if output.finished:
                    out.write("\n")
                    return shown
    except BaseException:
        engine.abort_request(request_id)
        raise


def run_chat(
    config: EngineConfig,
    make_params: Callable[[], SamplingParams],
    system: str | None,
    stdin: TextIO = sys.stdin,
    stdout: TextIO = sys.stdout,
) -> int:
    engine = LLMEngine(config)
    if engine.tokenizer is None or engine.tokenizer.chat_template is None:
        raise ValueError("this model has no chat template; use `forklift generate --raw`")
    base = [{"role": "system", "content": system}] if system else []
    messages = list(base)
    stdout.write(HELP + "\n")
    while True:
        stdout.write("> ")
        stdout.flush()
        line = stdin.readline()
        if not line:
            stdout.write("\n")
            return 0
        line = line.strip()
        if line == "/exit":
            return 0
        if line == "/reset":
            messages = list(base)
            continue
        if not line:
            continue
        messages.append({"role": "user", "content": line})
        reply = stream_reply(engine, messages, make_params(), stdout)
        messages.append({"role": "assistant", "content": reply})
