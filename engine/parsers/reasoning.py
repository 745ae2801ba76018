"""Reasoning parser: the `<think>...</think>` block of DeepSeek-R1 and Qwen3 style models.

Some chat templates open the block themselves (the generation prompt ends with `<think>`), so
the output starts inside it: `opens_itself` says so. Without a closing tag the whole output is
reasoning then (the model ran out of tokens while thinking); without an opening tag and
without `opens_itself` it is all content.
"""

from __future__ import annotations

import re


class ReasoningParser:
    name = "think"
    open, close = "<think>", "</think>"

    def __init__(self, opens_itself: bool = False):
        self.opens_itself = opens_itself

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning, content); reasoning is None when the text has no reasoning block."""
        start = text.find(self.open)
        if start >= 0 and not text[:start].strip():
            body = start + len(self.open)
        elif self.opens_itself:
            body = 0
        else:
            return None, text
        end = text.find(self.close, body)
        if end < 0:
            return text[body:].strip(), ""
        return text[body:end].strip(), text[end + len(self.close):].lstrip()


REASONING_PARSERS = {"think": ReasoningParser, "deepseek-r1": ReasoningParser,
                     "qwen3": ReasoningParser}


def reasoning_parser(name: str, opens_itself: bool = False) -> ReasoningParser:
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {sorted(REASONING_PARSERS)}")
    return REASONING_PARSERS[name](opens_itself)


def detect_reasoning_parser(chat_template: str | None) -> tuple[str, bool] | None:
    """("think", opens_itself) when a chat template knows the block, else None. It opens the
    block itself when its generation prompt writes `<think>` (outside a disabled-thinking
    branch that closes it again at once)."""
    if not chat_template or "<think>" not in chat_template:
        return None
    prompt = chat_template[chat_template.rfind("add_generation_prompt"):]
    opens = re.search(r"<think>(?!\s*(\\n)*\s*</think>)", prompt) is not None
    return "think", opens
