"""Programs: SGLang's frontend language on token state.

    @function
    def qa(s, question):
        s += system("Be brief.") + user(question) + assistant(gen("answer", max_new_tokens=32))
        branches = s.fork(4)
        branches += user("Sure?") + assistant(gen("check", max_new_tokens=8))

    states = qa.run_batch([{"question": "2+2?"}], client=client)

A state holds ids, loss mask, logprobs, versions and variables; nothing is re-tokenized. Chat
roles are appended as token deltas of the template (as ToolLoop does). `gen` appends the model's
tokens (mask 1, engine logprobs and versions); text, roles and `select`ed choices mask 0.
`s.fork(k)` copies the state; the branches' requests share the prefix KV through the radix
cache, and `branches += gen(...)` on branches still identical is a single n=k request.
`select(name, choices)` scores every choice by the sum of its tokens' logprobs under the model
(raw logprobs, teacher-forced through the engine) and picks the best (greedy; `temperature>0`
samples from softmax(score / temperature)).
"""

from __future__ import annotations

import copy
import functools
import math
import random
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from hotswap.rollout.client import Completion, TokenClient
from hotswap.rollout.tool_loop import TemplateDeltas
from hotswap.rollout.trajectory import Trajectory

_FORCE = 1e4  # a logit bias that makes greedy decoding emit the given token


class Expr:
    def __add__(self, other: Any) -> Concat:
        return Concat([self, _expr(other)])

    def __radd__(self, other: Any) -> Concat:
        return Concat([_expr(other), self])


def _expr(value: Any) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Text(value)
    raise TypeError(f"cannot append {type(value).__name__} to a program state")


@dataclass
class Text(Expr):
    text: str


@dataclass
class Concat(Expr):
    parts: list[Expr]

    def __add__(self, other: Any) -> Concat:
        return Concat([*self.parts, _expr(other)])


@dataclass
class Role(Expr):
    role: str
    content: Expr


@dataclass
class Gen(Expr):
    name: str | None
    sampling: dict[str, Any]


@dataclass
class Select(Expr):
    name: str
    choices: list[str]
    temperature: float = 0.0


def system(content: Any) -> Role:
    return Role("system", _expr(content))


def user(content: Any) -> Role:
    return Role("user", _expr(content))


def assistant(content: Any) -> Role:
    return Role("assistant", _expr(content))


def gen(name: str | None = None, **sampling: Any) -> Gen:
    """Generate (max_new_tokens, temperature, stop ...); the text is stored as s[name]."""
    return Gen(name, sampling)


def select(name: str, choices: Sequence[str], temperature: float = 0.0) -> Select:
    if not choices:
        raise ValueError("select: choices is empty")
    return Select(name, list(choices), temperature)


@dataclass
class ProgramState:
    client: TokenClient
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str | None] = field(default_factory=list)
    variables: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, str]] = field(default_factory=list)
    cached_tokens: int = 0
    first_gen: int | None = None  # where the first generated token sits: prompt / response
    rng: random.Random = field(default_factory=random.Random)

    def __getitem__(self, name: str) -> Any:
        return self.variables[name]

    def __iadd__(self, expr: Any) -> ProgramState:
        _run(self, _expr(expr))
        return self

    def fork(self, k: int) -> Forks:
        if k < 1:
            raise ValueError(f"fork: k must be >= 1, got {k}")
        return Forks([self._copy() for _ in range(k)])

    def _copy(self) -> ProgramState:
        other = copy.copy(self)
        for name in ("ids", "mask", "logprobs", "versions", "messages"):
            setattr(other, name, list(getattr(self, name)))
        other.variables = dict(self.variables)
        return other

    @property
    def deltas(self) -> TemplateDeltas:
        return _deltas(self.client.tokenizer)

    def text(self) -> str:
        return self.client.tokenizer.decode(self.ids, skip_special_tokens=False)

    def to_trajectory(self, **fields: Any) -> Trajectory:
        """Prompt = the tokens before the first gen; response = the rest with its masks."""
        cut = len(self.ids) if self.first_gen is None else self.first_gen
        return Trajectory(prompt_ids=self.ids[:cut], response_ids=self.ids[cut:],
                          loss_mask=self.mask[cut:], logprobs=self.logprobs[cut:],
                          versions=self.versions[cut:], messages=list(self.messages),
                          **fields)

    # appending

    def _context(self, ids: list[int]) -> None:
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [None] * len(ids)

    def _generated(self, comp: Completion) -> None:
        if self.first_gen is None:
            self.first_gen = len(self.ids)
        self.ids += comp.output_ids
        self.mask += [1] * len(comp.output_ids)
        self.logprobs += comp.logprobs
        self.versions += comp.versions
        self.cached_tokens += comp.cached_tokens


class Forks(list):
    """Branches of one state; `forks += expr` appends to each (identical branches generate
    with one n=k request)."""

    def __iadd__(self, expr: Any) -> Forks:  # type: ignore[override]
        _run_many(list(self), _expr(expr))
        return self


@functools.lru_cache(maxsize=8)
def _deltas(tokenizer: Any) -> TemplateDeltas:
    return TemplateDeltas(tokenizer)


def _run(state: ProgramState, expr: Expr) -> None:
    _run_many([state], expr)


def _run_many(states: list[ProgramState], expr: Expr) -> None:
    if isinstance(expr, Concat):
        for part in expr.parts:
            _run_many(states, part)
    elif isinstance(expr, Text):
        for s in states:
            s._context(list(s.client.tokenizer.encode(expr.text, add_special_tokens=False)))
    elif isinstance(expr, Role):
        _run_role(states, expr)
    elif isinstance(expr, Gen):
        _run_gen(states, expr)
    elif isinstance(expr, Select):
        for s in states:
            _run_select(s, expr)
    else:
        raise TypeError(f"unknown program expression {expr!r}")


def _run_role(states: list[ProgramState], role: Role) -> None:
    if role.role != "assistant":
        if not isinstance(role.content, Text):
            raise ValueError(f"{role.role}(...): content must be text")
        for s in states:
            msg = {"role": role.role, "content": role.content.text}
            s._context(_message_ids(s, msg))
            s.messages.append(msg)
        return
    for s in states:
        s._context(_message_ids(s, None))  # the generation prompt
    starts = [len(s.ids) for s in states]
    _run_many(states, role.content)
    for s, start in zip(states, starts):
        s._context(s.deltas.close_turn(s.ids[start:]))
        body = s.ids[start:]
        body = body[: len(body) - _overlap(s.deltas, body)]
        s.messages.append({"role": "assistant", "content": s.client.tokenizer.decode(
            body, skip_special_tokens=False)})


def _message_ids(state: ProgramState, msg: dict | None) -> list[int]:
    """Template tokens for one more message (None: the assistant generation prompt)."""
    if msg is None:
        return state.deltas.generation_prompt()
    if not state.ids:  # the conversation starts here: render it whole, once
        tok = state.client.tokenizer
        return list(tok.encode(tok.apply_chat_template([msg], tokenize=False),
                               add_special_tokens=False))
    return state.deltas.message(msg)


def _overlap(deltas: TemplateDeltas, body: list[int]) -> int:
    return len(deltas.closing) - len(deltas.close_turn(body))


def _run_gen(states: list[ProgramState], g: Gen) -> None:
    client = states[0].client
    same = all(s.ids == states[0].ids for s in states)
    if same and len(states) > 1:  # a fresh fork: one request, prefilled once
        comps = client.generate(states[0].ids, n=len(states), **g.sampling)
    else:
        comps = client.generate([s.ids for s in states], n=1, **g.sampling)
    for s, comp in zip(states, comps):
        s._generated(comp)
        if g.name is not None:
            s.variables[g.name] = s.client.tokenizer.decode(comp.output_ids,
                                                            skip_special_tokens=True)


def choice_logprobs(client: TokenClient, prefix: list[int], choice_ids: list[int]
                    ) -> list[float]:
    """Raw model logprob of each choice token after prefix (forced greedy, one token a call)."""
    out = []
    for j, token in enumerate(choice_ids):
        comp = client.generate(prefix + choice_ids[:j], n=1, max_new_tokens=1, temperature=0,
                               logit_bias={token: _FORCE}, logprob_mode="raw",
                               ignore_eos=True, min_new_tokens=0)[0]
        if comp.output_ids != [token]:
            raise RuntimeError("select: the engine did not emit the forced choice token")
        out.append(comp.logprobs[0])
    return out


def _run_select(state: ProgramState, sel: Select) -> None:
    tok = state.client.tokenizer
    encoded = [list(tok.encode(c, add_special_tokens=False)) for c in sel.choices]
    scores = [sum(choice_logprobs(state.client, state.ids, ids)) for ids in encoded]
    if sel.temperature > 0:
        top = max(scores)
        weights = [math.exp((x - top) / sel.temperature) for x in scores]
        pick = state.rng.choices(range(len(scores)), weights)[0]
    else:
        pick = max(range(len(scores)), key=scores.__getitem__)
    state._context(encoded[pick])
    state.variables[sel.name] = sel.choices[pick]
    state.variables[f"{sel.name}_scores"] = scores


class Function:
    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        functools.update_wrapper(self, fn)

    def run(self, client: TokenClient, seed: int | None = None, **kwargs: Any) -> ProgramState:
        state = ProgramState(client, rng=random.Random(seed))
        self.fn(state, **kwargs)
        return state

    def run_batch(self, rows: Sequence[dict], client: TokenClient, max_workers: int = 32,
                  seed: int | None = 0) -> list[ProgramState]:
        """Run the program once per row (a dict of its arguments), concurrently."""
        with ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="program") as pool:
            futures = [pool.submit(self.run, client, None if seed is None else seed + i, **row)
                       for i, row in enumerate(rows)]
            return [f.result() for f in futures]


def function(fn: Callable[..., Any]) -> Function:
    """Decorate `def prog(s, ...)`; call prog.run(client, **args) or prog.run_batch(rows, ...)."""
    return Function(fn)
