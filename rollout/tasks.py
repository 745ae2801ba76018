"""The GRPO job's tasks: rows, agent loop and reward, chosen by `--task`.

`addition`: single-digit sums, one turn, exact match on the last number of the reply.
`tools`: multi-digit arithmetic that a small model cannot do in its head, with a `calculator`
tool called in the Hermes format and run by `ToolLoop`; the reward checks the final answer.
`shapes` (vision-language models): a drawn image of a few circles, squares and triangles and the
question how many there are; the image travels in the chat message (an image part), exact match.
"""

from __future__ import annotations

import ast
import json
import math
import random
import re
import threading
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from PIL import Image, ImageDraw

from hotswap.rollout.agent_loops import SingleTurn
from hotswap.rollout.rewards import RewardFn, exact_match
from hotswap.rollout.tool_loop import ToolLoop, hermes_tool_calls
from hotswap.rollout.trajectory import Trajectory

TASKS = ("addition", "tools", "shapes")
MAX_EXPRESSION_CHARS = 200


def addition_rows(count: int, seed: int) -> list[dict]:
    """Single-digit additions: the answer is checked exactly (the last number in the reply)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        question = f"What is {a} + {b}? Reply with just the number."
        rows.append({"messages": [{"role": "user", "content": question}], "answer": a + b})
    return rows


SHAPES_QUESTION = "How many shapes are in the image? Answer with a number."
SHAPE_KINDS = ("circle", "square", "triangle")
# Sides in pixels: the tiny test processors (14-16 px patches, 2x2 merged) give 4 to 16 image
# tokens; a real Qwen2-VL processor gives 4 to 16 as well (28 px per merged token).
SHAPE_SIDES = (56, 84, 112)


def draw_shapes(count: int, side: int, rng: random.Random) -> Image.Image:
    """`count` shapes of random kinds and colours on a plain background, each in its own cell
    of a 2x2 grid (so none overlap and the count is unambiguous), jittered inside the cell."""
    background = tuple(rng.randint(200, 255) for _ in range(3))
    image = Image.new("RGB", (side, side), background)
    draw = ImageDraw.Draw(image)
    cell = side // 2
    for index in rng.sample(range(4), count):
        size = rng.randint(cell // 2, cell - 4)
        x0 = (index % 2) * cell + rng.randint(2, cell - size - 2)
        y0 = (index // 2) * cell + rng.randint(2, cell - size - 2)
        box = (x0, y0, x0 + size, y0 + size)
        colour = tuple(rng.randint(0, 160) for _ in range(3))
        kind = rng.choice(SHAPE_KINDS)
        if kind == "circle":
            draw.ellipse(box, fill=colour)
        elif kind == "square":
            draw.rectangle(box, fill=colour)
        else:
            draw.polygon([(x0, y0 + size), (x0 + size, y0 + size), (x0 + size // 2, y0)],
                         fill=colour)
    return image


def shapes_rows(count: int, seed: int) -> list[dict]:
    """One to four shapes per image; the chat's user message holds the image and the question
    (an image part, then a text part); the answer is the count."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        shapes = rng.randint(1, 4)
        image = draw_shapes(shapes, rng.choice(SHAPE_SIDES), rng)
        content = [{"type": "image", "image": image}, {"type": "text", "text": SHAPES_QUESTION}]
        rows.append({"messages": [{"role": "user", "content": content}], "answer": shapes})
    return rows


_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
        ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b}


def calculator(expression: str) -> str:
    """+ - * / and parentheses on decimal numbers, exactly (fractions); anything else is a
    ValueError. The text is parsed to a syntax tree and only arithmetic nodes are evaluated."""
    if not isinstance(expression, str) or len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression must be a string of at most {MAX_EXPRESSION_CHARS} chars")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, RecursionError, MemoryError) as exc:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from exc
    return _format(_evaluate(tree.body))


def _evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if not math.isfinite(node.value):
            raise ValueError(f"not a finite number: {node.value}")
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ValueError("division by zero")
        return _OPS[type(node.op)](left, right)
    raise ValueError(f"only numbers, + - * / and parentheses are allowed, not "
                     f"{type(node).__name__}")


def _format(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.10g}"


CALCULATOR_SCHEMA = {"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression exactly: numbers, + - * / and parentheses.",
    "parameters": {"type": "object", "required": ["expression"], "properties": {
        "expression": {"type": "string", "description": "e.g. (12 + 30) * 4"}}}}}


def _call_text(expression: str) -> str:
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


# The tools go in the system prompt (Hermes layout), so any chat template carries them; the
# worked example is one exchange in the chat itself, on a problem the rows never ask.
TOOL_SYSTEM_PROMPT = (
    "You are a helpful assistant. You cannot do long arithmetic in your head, so you use the "
    "calculator tool.\n<tools>\n" + json.dumps(CALCULATOR_SCHEMA) + "\n</tools>\n"
    "To call the tool, reply with only:\n"
    '<tool_call>{"name": "calculator", "arguments": {"expression": "..."}}</tool_call>\n'
    "The result comes back in a tool message. Then reply with the final number.")
WORKED_EXAMPLE = [
    {"role": "user", "content": "What is 4821 * 397? Use the calculator."},
    {"role": "assistant", "content": _call_text("4821 * 397")},
    {"role": "tool", "content": "1913937"},
    {"role": "assistant", "content": "4821 * 397 = 1913937"}]


def tool_rows(count: int, seed: int) -> list[dict]:
    """Products of a 3-digit and a 3-4 digit number, or sums of three 5-6 digit numbers."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        if rng.random() < 0.5:
            terms, op = [rng.randint(100, 999), rng.randint(100, 9999)], " * "
            answer = terms[0] * terms[1]
        else:
            terms, op = [rng.randint(10_000, 999_999) for _ in range(3)], " + "
            answer = sum(terms)
        question = f"What is {op.join(map(str, terms))}? Use the calculator."
        rows.append({"messages": [{"role": "system", "content": TOOL_SYSTEM_PROMPT},
                                  *WORKED_EXAMPLE, {"role": "user", "content": question}],
                     "answer": answer})
    return rows


class ToolReward:
    """1.0 when the final answer (the last assistant turn, written after the last tool result)
    holds the row's answer as a whole number; else `format_reward` when the trajectory made at
    least one well-formed call and no malformed one; else 0. Every trajectory it scores is
    tallied for the step's tool metrics (`take`)."""

    def __init__(self, format_reward: float = 0.0, answer_key: str = "answer"):
        self.format_reward, self.answer_key = format_reward, answer_key
        self._lock = threading.Lock()
        self._seen: list[dict[str, float]] = []

    def __call__(self, traj: Trajectory) -> dict[str, float]:
        score = tool_score(traj, self.answer_key)
        score["reward"] = 1.0 if score["correct"] else self.format_reward * score["well_formed"]
        with self._lock:
            self._seen.append(score)
        return score

    def take(self) -> list[dict[str, float]]:
        """The scores given since the last take."""
        with self._lock:
            seen, self._seen = self._seen, []
        return seen


def tool_score(traj: Trajectory, answer_key: str = "answer") -> dict[str, float]:
    """A trajectory's tool figures: calls parsed, calls malformed, turns, a right final answer
    (the model stopped on its own with the number), a well-formed call and no malformed one."""
    calls, errors = traj.tool_calls, traj.parse_errors
    correct = traj.finish_reason == "stop" and answer_in(traj.text, traj.row[answer_key])
    return {"tool_calls": float(calls), "parse_errors": float(errors),
            "turns": float(traj.num_turns), "correct": float(correct),
            "well_formed": float(calls > 0 and errors == 0)}


def answer_in(text: str, answer: Any) -> bool:
    """`answer` appears in `text` as a whole number (thousands commas allowed), outside any
    tool call."""
    text = re.sub(r"<tool_call>.*?(</tool_call>|$)", " ", text, flags=re.S)
    numbers = re.findall(r"(?<![\d.])-?\d[\d,]*(?:\.\d+)?", text)
    return str(answer) in {n.replace(",", "") for n in numbers}


@dataclass(frozen=True)
class Task:
    name: str
    rows: Any  # fn(count, seed) -> list of rows
    loop: Any  # SingleTurn or ToolLoop
    reward: RewardFn


def make_task(name: str, max_new_tokens: int, max_turns: int = 3,
              format_reward: float = 0.0) -> Task:
    if name == "addition":
        return Task(name, addition_rows, SingleTurn(), exact_match())
    if name == "tools":
        # a turn stops at its call; the response budget holds every turn and the tool results
        loop = ToolLoop({"calculator": calculator}, max_turns=max_turns,
                        max_tokens=max_turns * (max_new_tokens + 32), parse=hermes_tool_calls,
                        stop=["</tool_call>"])
        return Task(name, tool_rows, loop, ToolReward(format_reward))
    if name == "shapes":
        return Task(name, shapes_rows, SingleTurn(), exact_match())
    raise ValueError(f"unknown task {name!r}; one of {TASKS}")


__all__ = ["TASKS", "Task", "ToolReward", "addition_rows", "answer_in", "calculator",
           "draw_shapes", "make_task", "shapes_rows", "tool_rows", "tool_score"]
