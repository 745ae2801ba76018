"""SamplingParams: every key of docs/api.md#sampling-parameters, validated on construction.

Bad values raise ValueError naming the field; normal forms (tuples, int token ids, a JSON string
for json_schema) make params hashable and comparable.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from itertools import chain
from typing import Any

from hotswap.engine.client.protocol import MAX_N

MAX_ABS_PENALTY = 2.0  # OpenAI's range for frequency/presence penalties
GREEDY_TEMPERATURE = 1e-5  # temperatures below this are treated as 0 (dividing by them overflows)
LOGPROB_MODES = ("processed", "raw")
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "choices")

_MASK64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def seeded_uniform(seed: int, step: int) -> float:
    """A uniform in [0, 1) that depends only on (seed, step): a counter-based hash, no state."""
    z = _splitmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64))
    return (z >> 11) * 2.0**-53


def _fail(name: str, expected: str, value: Any) -> None:
    raise ValueError(f"sampling_params.{name}: expected {expected}, got {value!r}")


def _as_int(name: str, value: Any, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(name, "an integer", value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        _fail(name, f"an integer in [{lo}, {hi if hi is not None else 'inf'}]", value)
    return value


def _as_float(name: str, value: Any, lo: float, hi: float, lo_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(name, "a number", value)
    value = float(value)
    too_low = value <= lo if lo_open else value < lo
    if not math.isfinite(value) or too_low or value > hi:
        _fail(name, f"a finite number in {'(' if lo_open else '['}{lo}, {hi}]", value)
    return value


def _as_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        _fail(name, "true or false", value)
    return value


def _as_str_list(name: str, value: Any, allow_str: bool) -> tuple[str, ...]:
    items = [value] if allow_str and isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) and s for s in items):
        _fail(name, "a non-empty string or a list of them" if allow_str else "a list of strings",
              value)
    return tuple(items)


def _as_token_ids(name: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        _fail(name, "a list of token ids", value)
    return tuple(_as_int(name, t, lo=0) for t in value)


def _as_logit_bias(value: Any) -> dict[int, float]:
    if not isinstance(value, Mapping):
        _fail("logit_bias", "a dict of token id -> bias", value)
    bias: dict[int, float] = {}
    for key, b in value.items():
        tid = key if isinstance(key, int) and not isinstance(key, bool) else None
        if isinstance(key, str) and key.strip().lstrip("-").isdigit():
            tid = int(key)
        if tid is None or tid < 0:
            _fail("logit_bias", "non-negative integer token ids as keys", key)
        if tid in bias:
            _fail("logit_bias", "each token id once", key)
        bias[tid] = _as_float("logit_bias", b, -math.inf, math.inf)
    return bias


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling parameters, validated and normalised at construction.

    Normal forms: `stop` and `stop_token_ids` are tuples, `choices` a tuple, `json_schema` a JSON
    string, `logit_bias` a dict with int keys, numbers are floats. At most one grammar field is set.
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    seed: int | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    choices: tuple[str, ...] | None = None
    logit_bias: dict[int, float] | None = None
    logprob_mode: str = "processed"
    speculative: bool = True  # False: this request never speculates (the engine's speculative)

    def __post_init__(self) -> None:
        for name, value in _normalised_fields(self).items():
            object.__setattr__(self, name, value)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | SamplingParams | None) -> SamplingParams:
        """Parse the API's sampling_params dict; a None value means the default."""
        if d is None:
            return cls()
        if isinstance(d, SamplingParams):
            return d
        if not isinstance(d, Mapping):
            raise ValueError(f"sampling_params: expected a dict, got {type(d).__name__}")
        unknown = [k for k in d if k not in _FIELD_NAMES]
        if unknown:
            raise ValueError(
                f"sampling_params: unknown key(s) {', '.join(map(repr, unknown))}; "
                f"known keys: {', '.join(sorted(_FIELD_NAMES))}"
            )
        return cls(**{k: v for k, v in d.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def grammar(self) -> tuple[str, str | tuple[str, ...]] | None:
        """(kind, spec) of the one grammar field that is set, for the grammar module."""
        for name in GRAMMAR_FIELDS:
            if getattr(self, name) is not None:
                return name, getattr(self, name)
        return None

    def for_sample(self, index: int) -> SamplingParams:
        """Params of the index-th of n samples: n=1, and a distinct seed derived from `seed`
        (sample 0 keeps it), so seeded n>1 requests neither repeat nor depend on the batch."""
        seed = self.seed
        if seed is not None and index > 0:
            seed = _splitmix64(_splitmix64(seed & _MASK64) ^ index) >> 1
        return _replace(self, n=1, seed=seed)

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ValueError for token ids outside the vocabulary (call at admission)."""
        for tid in chain(self.stop_token_ids, self.logit_bias or ()):
            if tid >= vocab_size:
                field_name = "stop_token_ids" if tid in self.stop_token_ids else "logit_bias"
                _fail(field_name, f"token ids below the vocabulary size {vocab_size}", tid)


_FIELD_NAMES = frozenset(f.name for f in fields(SamplingParams))


def _replace(p: SamplingParams, **changes: Any) -> SamplingParams:
    return SamplingParams(**{**{f.name: getattr(p, f.name) for f in fields(p)}, **changes})


def _normalised_fields(p: SamplingParams) -> dict[str, Any]:
    out: dict[str, Any] = {
        "max_new_tokens": _as_int("max_new_tokens", p.max_new_tokens, lo=0),
        "min_new_tokens": _as_int("min_new_tokens", p.min_new_tokens, lo=0),
        "temperature": _as_float("temperature", p.temperature, 0.0, math.inf),
        "top_p": _as_float("top_p", p.top_p, 0.0, 1.0, lo_open=True),
        "min_p": _as_float("min_p", p.min_p, 0.0, 1.0),
        "repetition_penalty": _as_float("repetition_penalty", p.repetition_penalty, 0.0, math.inf,
                                        lo_open=True),
        "n": _as_int("n", p.n, lo=1, hi=MAX_N),
        "ignore_eos": _as_bool("ignore_eos", p.ignore_eos),
        "skip_special_tokens": _as_bool("skip_special_tokens", p.skip_special_tokens),
        "speculative": _as_bool("speculative", p.speculative),
        "stop": _as_str_list("stop", p.stop, allow_str=True) if p.stop is not None else (),
        "stop_token_ids": _as_token_ids("stop_token_ids", p.stop_token_ids or ()),
    }
    if out["min_new_tokens"] > out["max_new_tokens"]:
        _fail("min_new_tokens", f"at most max_new_tokens ({out['max_new_tokens']})",
              out["min_new_tokens"])
    top_k = _as_int("top_k", p.top_k)
    if top_k < -1:
        _fail("top_k", "-1 or 0 (off) or a positive integer", top_k)
    out["top_k"] = -1 if top_k == 0 else top_k  # 0 is "off" in vLLM and TRL
    for name in ("frequency_penalty", "presence_penalty"):
        out[name] = _as_float(name, getattr(p, name), -MAX_ABS_PENALTY, MAX_ABS_PENALTY)
    if p.seed is not None:
        out["seed"] = _as_int("seed", p.seed)
    if p.logprob_mode not in LOGPROB_MODES:
        _fail("logprob_mode", " or ".join(map(repr, LOGPROB_MODES)), p.logprob_mode)
    if p.logit_bias is not None:
        out["logit_bias"] = _as_logit_bias(p.logit_bias)
    out.update(_normalised_grammar(p))
    return out


def _normalised_grammar(p: SamplingParams) -> dict[str, Any]:
    given = [name for name in GRAMMAR_FIELDS if getattr(p, name) is not None]
    if len(given) > 1:
        raise ValueError(
            f"sampling_params: at most one of {', '.join(GRAMMAR_FIELDS)} may be set, "
            f"got {', '.join(given)}"
        )
    out: dict[str, Any] = {}
    if p.json_schema is not None:
        if isinstance(p.json_schema, dict):
            out["json_schema"] = json.dumps(p.json_schema)
        elif not isinstance(p.json_schema, str):
            _fail("json_schema", "a JSON schema as a string or a dict", p.json_schema)
    for name in ("regex", "ebnf"):
        if getattr(p, name) is not None and not isinstance(getattr(p, name), str):
            _fail(name, "a string", getattr(p, name))
    if p.choices is not None:
        out["choices"] = _as_str_list("choices", p.choices, allow_str=False)
        if not out["choices"]:
            _fail("choices", "a non-empty list of strings", p.choices)
    return out


