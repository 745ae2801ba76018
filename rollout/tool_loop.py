"""ToolLoop: multi-turn agent rollouts with tool calls, on token state.

Each turn the model's tokens are appended as generated (loss mask 1, engine logprobs and
versions). The template's turn-closing tokens and the tool messages are appended with loss mask 0
as token deltas of the chat template: the template is rendered for a fixed base conversation
with and without the new messages, and only the difference is tokenized. The conversation is
never re-rendered and the model's tokens are never re-tokenized (re-tokenizing drifts: verl saw
PPO stop converging).

A tool may show the model images: it returns a `ToolResult(text, images)`, the tool message then
holds an image part per image and the text, the template renders a placeholder per image, and
the next turn's request carries every image of the trajectory so far (`image_data`); the engine
expands the placeholders and the trajectory takes its expanded ids (Trajectory.adopt_expanded).

Finish reasons: "stop" (the model answered without a tool call), "length" (its last turn hit
max_new_tokens without a call), "max_turns" (it still called tools after max_turns turns),
"max_tokens" (the response, tool tokens included, reached max_tokens), "abort".
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hotswap.engine.parsers import ToolParser, tool_parser
from hotswap.rollout.client import Completion, TokenClient, row_images
from hotswap.rollout.trajectory import Trajectory

ToolCall = tuple[str, Any]  # (name, arguments) or ("", error message) for an unparsable call
_BASE = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
_MARK = "\u2063MARK\u2063"


@dataclass(frozen=True)
class ToolResult:
    """A tool's result with images for the model to see (any form the engine's image_data
    takes: PIL images, bytes, base64, data: URLs, paths), shown before the text."""

    text: str
    images: list[Any] = field(default_factory=list)

    def message(self, role: str) -> dict[str, Any]:
        """The tool message: plain text, or an image part per image and then the text."""
        if not self.images:
            return {"role": role, "content": self.text}
        parts: list[dict[str, Any]] = [{"type": "image", "image": im} for im in self.images]
        return {"role": role, "content": [*parts, {"type": "text", "text": self.text}]}


def calls_from(parser: ToolParser) -> Callable[[str], list[ToolCall]]:
    """ToolLoop's reading of a turn through a shared parser (hotswap.engine.parsers): each call
    as (name, arguments), then each span that did not parse as ("", the error)."""
    def parse(text: str) -> list[ToolCall]:
        got = parser.parse(text)
        return ([(c.name, json.loads(c.arguments)) for c in got.tool_calls]
                + [("", f"could not parse tool call {e.text!r}: {e.reason}") for e in got.errors])
    return parse


hermes_tool_calls = calls_from(tool_parser("hermes"))


class TemplateDeltas:
    """Token deltas of a chat template, computed once per tokenizer."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        closed = self._render([*_BASE, {"role": "assistant", "content": _MARK}], False)
        self.closing_text = closed[closed.index(_MARK) + len(_MARK):]
        self.closing = self._encode(self.closing_text)
        self._base_closed = closed.replace(_MARK, "")

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def close_turn(self, generated: list[int]) -> list[int]:
        """Template tokens that close an assistant turn, minus those the model produced."""
        k = len(self.closing)
        while k and generated[len(generated) - k:] != self.closing[:k]:
            k -= 1
        return self.closing[k:]

    def generation_prompt(self) -> list[int]:
        """Tokens that open an assistant turn after a closed message."""
        return self._suffix(self._render(_BASE, False), self._render(_BASE, True))

    def message(self, msg: dict) -> list[int]:
        """Tokens of one more (closed) message after a closed message."""
        return self._suffix(self._render(_BASE, False), self._render([*_BASE, msg], False))

    def _suffix(self, base: str, full: str) -> list[int]:
        if not full.startswith(base):
            raise ValueError("chat template: appending messages changes the rendered prefix; "
                             "token deltas are not possible with this template")
        return self._encode(full[len(base):])

    def messages(self, new: list[dict]) -> list[int]:
        """Tokens the template adds for `new` messages after a closed assistant turn, up to and
        including the next assistant generation prompt."""
        base = [*_BASE, {"role": "assistant", "content": ""}]
        return self._suffix(self._base_closed, self._render([*base, *new], True))


class ToolLoop:
    def __init__(self, tools: dict[str, Callable[..., Any]], max_turns: int = 8,
                 max_tokens: int = 2048, tool_timeout_s: float = 10.0,
                 parse: str | Callable[[str], list[ToolCall]] = "hermes",
                 tool_role: str = "tool", sessions: bool = False, **sampling: Any):
        """tools: name -> fn(**arguments) (or fn(arguments) when the arguments are not a dict);
        its return value (str(), or JSON for dicts/lists; a ToolResult for text with images)
        is the tool message. max_tokens: the response budget, tool tokens included. parse: a
        parser of hotswap.engine.parsers by name (hermes, qwen, llama3, mistral) or a function
        of the turn's text. sessions: each
        trajectory holds a session of the engine (open_session), so its KV stays pinned while
        its tools run; the first turn then sends one request per trajectory instead of n=G.
        sampling: per-turn params (max_new_tokens ...)."""
        if max_turns < 1 or max_tokens < 1:
            raise ValueError("max_turns and max_tokens must be >= 1")
        self.tools, self.max_turns, self.max_tokens = dict(tools), max_turns, max_tokens
        self.tool_timeout_s, self.tool_role = tool_timeout_s, tool_role
        self.sessions = sessions
        self.parse = calls_from(tool_parser(parse)) if isinstance(parse, str) else parse
        self.sampling = sampling
        self._deltas: dict[int, TemplateDeltas] = {}

    def deltas(self, tokenizer: Any) -> TemplateDeltas:
        if id(tokenizer) not in self._deltas:
            self._deltas[id(tokenizer)] = TemplateDeltas(tokenizer)
        return self._deltas[id(tokenizer)]

    def run_group(self, client: TokenClient, row: dict, group_size: int, group_id: int,
                  seed: int | None = None) -> list[Trajectory]:
        prompt = client.encode_row(row)
        deltas = self.deltas(client.tokenizer)
        images = row_images(row) or []
        trajs = [Trajectory(prompt_ids=prompt, group_id=group_id, sample_idx=k, row=row,
                            num_turns=0, messages=list(row.get("messages", [])),
                            images=list(images))
                 for k in range(group_size)]
        params = {**self.sampling, **row.get("sampling", {})}
        if seed is not None:
            params.setdefault("seed", seed)
        active = list(trajs)
        sessions = {id(t): client.backend.open_session() for t in trajs} if self.sessions else {}
        try:
            for turn in range(self.max_turns):
                comps = self._generate(client, prompt, active, turn, params, sessions)
                active = [t for t, c in zip(active, comps)
                          if self._after_turn(client, deltas, t, c, turn)]
                if not active:
                    break
        finally:
            for session in sessions.values():
                client.backend.close_session(session)
        return trajs

    def _generate(self, client: TokenClient, prompt: list[int], active: list[Trajectory],
                  turn: int, params: dict, sessions: dict[int, str]) -> list[Completion]:
        per_turn = int(params.get("max_new_tokens", client.sampling.get("max_new_tokens", 128)))
        room = min(self.max_tokens - len(t.response_ids) for t in active)
        turn_params = {**params, "max_new_tokens": max(1, min(per_turn, room))}
        if turn == 0 and not sessions:  # one request with n=G: the prompt is prefilled once
            return client.generate(prompt, n=len(active), image_data=active[0].images or None,
                                   **turn_params)
        seeds = None
        if "seed" in turn_params:
            turn_params["seed"] = turn_params["seed"] * 7919 + turn
            if sessions:  # one request per trajectory: each its own seed
                seeds = [turn_params["seed"] * 31 + t.sample_idx for t in active]
        session_ids = [sessions[id(t)] for t in active] if sessions else None
        images = [t.images or None for t in active]
        return client.generate([t.prompt_ids + t.response_ids for t in active], n=1,
                               session_id=session_ids, seeds=seeds,
                               image_data=images if any(images) else None, **turn_params)

    def _after_turn(self, client: TokenClient, deltas: TemplateDeltas, traj: Trajectory,
                    comp: Completion, turn: int) -> bool:
        """Append this turn; run its tool calls. True when the conversation continues."""
        tok = client.tokenizer
        traj.adopt_expanded(comp.prompt_ids, comp.image_meta)
        traj.append_generated(comp.output_ids, comp.logprobs, comp.versions, comp.routed_experts)
        traj.num_turns = turn + 1
        content_ids = comp.output_ids[: len(comp.output_ids) - _closing_overlap(
            deltas, comp.output_ids)]
        content = tok.decode(content_ids, skip_special_tokens=False)
        traj.text = tok.decode(content_ids, skip_special_tokens=True)
        traj.messages.append({"role": "assistant", "content": content})
        if comp.finish_type == "abort":
            traj.finish_reason = "abort"
            return False
        traj.append_context(deltas.close_turn(comp.output_ids))
        calls = self.parse(traj.text)
        if not calls:
            traj.finish_reason = "stop" if comp.finish_type == "stop" else "length"
            return False
        if turn + 1 >= self.max_turns:
            traj.finish_reason = "max_turns"
            return False
        traj.parse_errors += sum(1 for name, _ in calls if not name)
        traj.tool_calls += sum(1 for name, _ in calls if name)
        outs = [self.run_tool(name, args) for name, args in calls]
        results = [(out if isinstance(out, ToolResult) else ToolResult(out)).message(
            self.tool_role) for out in outs]
        # an image counts as its one placeholder here: the engine expands it next turn
        tool_ids = deltas.messages(results)
        if len(traj.response_ids) + len(tool_ids) >= self.max_tokens:
            traj.finish_reason = "max_tokens"
            return False
        traj.append_context(tool_ids)
        traj.messages += results
        traj.images += [im for out in outs if isinstance(out, ToolResult) for im in out.images]
        return True

    def run_tool(self, name: str, args: Any) -> str | ToolResult:
        """The tool's result as text (or its ToolResult); any failure becomes an error message
        for the model."""
        if not name:
            return f"Error: {args}"
        if name not in self.tools:
            return f"Error: unknown tool {name!r}; available: {sorted(self.tools)}"
        box: dict[str, Any] = {}

        def call() -> None:
            try:
                fn = self.tools[name]
                box["out"] = fn(**args) if isinstance(args, dict) else fn(args)
            except Exception as exc:  # the model sees the error and can retry
                box["err"] = f"Error: {type(exc).__name__}: {exc}"

        worker = threading.Thread(target=call, daemon=True, name=f"tool-{name}")
        worker.start()
        worker.join(self.tool_timeout_s)
        if worker.is_alive():
            return f"Error: tool {name!r} timed out after {self.tool_timeout_s}s"
        if "err" in box:
            return box["err"]
        out = box.get("out")
        return out if isinstance(out, (str, ToolResult)) else json.dumps(out)


def _closing_overlap(deltas: TemplateDeltas, generated: list[int]) -> int:
    """How many of the template's closing tokens the model generated itself (e.g. its eos)."""
    return len(deltas.closing) - len(deltas.close_turn(generated))
