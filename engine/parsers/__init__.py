"""Tool-call and reasoning parsers, one module for the server and the rollout layer."""

from hotswap.engine.parsers.reasoning import (
    REASONING_PARSERS,
    ReasoningParser,
    detect_reasoning_parser,
    reasoning_parser,
)
from hotswap.engine.parsers.tool_calls import (
    TOOL_PARSERS,
    Parsed,
    ParseError,
    ToolCall,
    ToolParser,
    detect_tool_parser,
    tool_parser,
)

__all__ = ["REASONING_PARSERS", "TOOL_PARSERS", "ParseError", "Parsed", "ReasoningParser",
           "ToolCall", "ToolParser", "detect_reasoning_parser", "detect_tool_parser",
           "reasoning_parser", "tool_parser"]
