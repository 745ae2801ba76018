"""The `<think>` reasoning parser, with and without a template that opens the block itself."""

from __future__ import annotations

import pytest

from hotswap.engine.parsers import detect_reasoning_parser, reasoning_parser


@pytest.mark.parametrize("text,opens,want", [
    ("<think>\nadd 2 and 2\n</think>\n\nIt is 4.", False, ("add 2 and 2", "It is 4.")),
    ("add 2 and 2</think>It is 4.", True, ("add 2 and 2", "It is 4.")),
    ("<think>still thinking", False, ("still thinking", "")),
    ("still thinking", True, ("still thinking", "")),
    ("It is 4.", False, (None, "It is 4.")),
    ("It is <think>4</think>.", False, (None, "It is <think>4</think>.")),
])
def test_the_reasoning_block_is_split_from_the_content(text, opens, want) -> None:
    assert reasoning_parser("qwen3", opens_itself=opens).split(text) == want


def test_the_parser_is_found_by_name_and_from_the_template() -> None:
    with pytest.raises(ValueError, match="think"):
        reasoning_parser("nope")
    opens = "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
    assert detect_reasoning_parser(opens) == ("think", True)
    closes = ("{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- if "
              "enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
              "{%- endif %}")
    assert detect_reasoning_parser(closes) == ("think", False)
    assert detect_reasoning_parser("{{ messages }}") is None
