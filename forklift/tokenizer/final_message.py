"""`continue_final_message`: a prompt that stops inside the conversation's last message, so
the model carries on writing that message instead of starting a new turn."""

from __future__ import annotations

from typing import Any

# Appended to the final message before rendering, and the rendered text is cut where it
# lands. Its trailing space shows whether the template trims the ends of messages: if it
# does, the cut is trimmed too, as transformers does.
_MARK = "<|forklift-continue-here|> "


def mark_final_message(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with the mark at the end of the last one's content."""
    if not messages:
        raise ValueError("continue_final_message needs a final message to continue")
    last = messages[-1]
    content = last.get("content")
    if not isinstance(content, str):
        raise ValueError("continue_final_message: the final message has no text to continue")
    return [*messages[:-1], {**last, "content": content + _MARK}]


def cut_at_mark(rendered: str) -> str:
    """The rendered prompt up to the end of the final message's content."""
    at = rendered.rfind(_MARK.rstrip())
    if at < 0:
        raise ValueError(
            "continue_final_message: the chat template dropped the end of the final message, "
            "so the prompt cannot stop inside it"
        )
    if rendered.startswith(_MARK, at):
        return rendered[:at]
    return rendered[:at].rstrip()
