"""The requests of the engine interface, each defined once (docs/design.md#one-request).

`GenerateRequest` is every argument of generate: its fields in SGLang's order, their defaults,
which are given per prompt, and the shape checks every implementation shares. The public
signatures of `generate`, `async_generate`, `prefill` and `generate_from_handoff` are made from
its fields (`request_method`), so Engine, RemoteEngine, Router, RayFleet, PDRouter and the Ray
replica client take the same keywords without spelling them out, and the HTTP routes' bodies
are its fields too. A new argument is one field here, plus its handling where it is used.
`ClassifyRequest` does the same for classify and async_classify (a reward model's scores),
sharing the prompt inputs and their split into rows (`PromptRequest`). `DistributedUpdate` does
the same for update_weights_from_distributed and prepare_weights_from_distributed. Each has a
`model` field: the served model the call is for (docs/api.md#model-names-and-frozen-models).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import inspect
import io
import os
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from PIL import Image

if TYPE_CHECKING:  # Python >= 3.11; the annotations are never evaluated
    from typing import Self

PROMPT_INPUTS = ("prompt", "input_ids", "messages")  # exactly one is given
IMAGES = "images"  # image_data's per-prompt kind: a list of images (or one image)
MAX_TOP_LOGPROBS = 100
PNG_MODES = ("1", "L", "LA", "I", "P", "RGB", "RGBA")  # what PNG stores as it is


def _per_prompt(kind: type) -> Any:
    """A field given once for every prompt, or as a list with one value (or None) per prompt."""
    return field(default=None, metadata={"per_prompt": kind})


class Request:
    """What the requests share: the fields named in POSITIONAL are positional in the methods
    made from them (in field order), the rest keyword-only."""

    POSITIONAL: ClassVar[tuple[str, ...]] = ()

    def body(self) -> dict[str, Any]:
        """The fields that differ from their defaults: what travels over HTTP or to a replica,
        so that the receiving engine applies its own defaults."""
        return {f.name: value for f in dataclasses.fields(self)  # type: ignore[arg-type]
                if (value := getattr(self, f.name)) is not None and value != f.default}

    def replace(self, **changes: Any) -> Any:
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]


class PromptRequest(Request):
    """A request given prompts (PROMPT_INPUTS, exactly one): generate's and classify's. Each
    subclass has the fields prompt, input_ids, messages and rid, per-prompt fields marked with
    _per_prompt, and checks its per-call fields in _check_call_fields."""

    @property
    def kind(self) -> str:
        """Which prompt input the request gives: "prompt", "input_ids" or "messages"."""
        given = [name for name in PROMPT_INPUTS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of prompt, input_ids, messages")
        return given[0]

    def split(self) -> tuple[list[Self], bool]:
        """One request per prompt, its per-prompt fields single values and its rid set, after
        the checks that need no model; and whether the call gave one prompt (not a list), so
        that its output is a dict, not a list. Raises ValueError naming the field."""
        kind = self.kind
        values, single = _prompts(kind, getattr(self, kind))
        self._check_call_fields()
        count = len(values)
        columns = {f.name: _listed(getattr(self, f.name), count, f.name, f.metadata["per_prompt"],
                                   single)
                   for f in dataclasses.fields(self) if "per_prompt" in f.metadata}
        rids = [r for r in columns["rid"] if r is not None]
        if len(set(rids)) < len(rids):
            raise ValueError("rid values must be unique")
        columns["rid"] = [r or uuid.uuid4().hex for r in columns["rid"]]
        rows = [self.replace(**{kind: value}, **{name: column[i] for name, column in
                                                 columns.items()})
                for i, value in enumerate(values)]
        return rows, single

    @classmethod
    def join(cls, rows: list[Self]) -> Self:
        """Rows of one call (split's, same prompt input and per-call fields) as one request
        for a list of prompts."""
        first = rows[0]
        per_prompt = {f.name for f in dataclasses.fields(cls) if "per_prompt" in f.metadata}
        listed = {name: [getattr(r, name) for r in rows] for name in per_prompt}
        listed = {name: values for name, values in listed.items()
                  if any(v is not None for v in values)}
        return first.replace(**{first.kind: [getattr(r, first.kind) for r in rows]},
                             **{name: listed.get(name) for name in per_prompt})

    @property
    def value(self) -> Any:
        """A row's prompt: its text, token ids or conversation."""
        return getattr(self, self.kind)

    def _check_call_fields(self) -> None:
        """Raises ValueError naming a per-call field of the wrong type or range."""


@dataclass(frozen=True)
class GenerateRequest(PromptRequest):
    POSITIONAL: ClassVar[tuple[str, ...]] = ("prompt", "sampling_params", "input_ids")  # SGLang's

    prompt: str | list[str] | None = None
    sampling_params: dict | list[dict] | None = _per_prompt(dict)
    input_ids: list[int] | list[list[int]] | None = None
    # chat messages (a conversation, or a list of them); the chat template is applied
    messages: list[dict] | list[list[dict]] | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    lora_name: str | list[str | None] | None = _per_prompt(str)  # None: the base model
    cache_salt: str | list[str | None] | None = _per_prompt(str)  # other salts share no KV
    rid: str | list[str | None] | None = _per_prompt(str)  # generated when absent
    stream: bool = False
    # MoE models: meta_info["routed_experts"] (docs/moe.md)
    return_routed_experts: bool = False
    # an open session's (open_session): the turn's KV stays pinned after it
    session_id: str | list[str | None] | None = _per_prompt(str)
    model: str | None = None  # the served model's name (a fleet routes by it); None: the policy
    # A vision-language model's images: per prompt a list of them (PIL image, bytes, base64,
    # a data: URL, a local path), one placeholder run each in the prompt's order
    image_data: Any = field(default=None, metadata={"per_prompt": IMAGES})

    @property
    def samples(self) -> int:
        """A row's sample count (its sampling_params' n)."""
        n = (self.sampling_params or {}).get("n", 1)
        return n if isinstance(n, int) and n > 0 else 1

    def sample_ids(self) -> list[str]:
        """A row's output ids: its rid, or "rid-k" for the k-th of n samples."""
        rid = str(self.rid)
        return [rid] if self.samples == 1 else [f"{rid}-{k}" for k in range(self.samples)]

    def body(self) -> dict[str, Any]:
        """As Request.body, images as strings (data: URLs) that travel as JSON."""
        out = super().body()
        if self.image_data is not None:
            out["image_data"] = _map_images(self.image_data, image_json)
        return out

    def _check_call_fields(self) -> None:
        for name in ("return_logprob", "stream", "return_routed_experts"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool")
        _check_model(self.model)
        top = self.top_logprobs_num
        if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs_num must be an integer in [0, {MAX_TOP_LOGPROBS}]")


@dataclass(frozen=True)
class ClassifyRequest(PromptRequest):
    """classify's arguments: prompts scored by a reward model (docs/api.md#scoring). A sequence's
    scores come from its last token; per-token scores (return_token_scores, or step_tag_id's
    steps) need every position's hidden state, so such a request reads no cached prefix."""

    POSITIONAL: ClassVar[tuple[str, ...]] = ("prompt", "input_ids", "messages")

    prompt: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    # chat messages (a conversation, or a list of them); the reward model's chat template
    messages: list[dict] | list[list[dict]] | None = None
    # False: raw values; True: sigmoid for one class, softmax over the classes otherwise
    activation: bool = False
    return_token_scores: bool = False  # "token_scores": one row per prompt token
    # "step_scores": one row per position whose token is step_tag_id (vLLM's STEP pooling)
    step_tag_id: int | None = None
    # the classes returned (columns of every row, in this order; activation over them); None: all
    returned_token_ids: list[int] | None = None
    cache_salt: str | list[str | None] | None = _per_prompt(str)  # other salts share no KV
    rid: str | list[str | None] | None = _per_prompt(str)  # generated when absent
    model: str | None = None  # the reward model's served name (a fleet routes by it)

    @property
    def per_token(self) -> bool:
        return self.return_token_scores or self.step_tag_id is not None

    def _check_call_fields(self) -> None:
        for name in ("activation", "return_token_scores"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool")
        _check_model(self.model)
        tag = self.step_tag_id
        if tag is not None and (not isinstance(tag, int) or isinstance(tag, bool) or tag < 0):
            raise ValueError("step_tag_id must be a non-negative integer (a token id)")
        classes = self.returned_token_ids
        if classes is not None and not (_ids(classes) and min(classes) >= 0):
            raise ValueError("returned_token_ids must be a non-empty list of non-negative "
                             "integers (class indices)")


@dataclass(frozen=True)
class DistributedUpdate(Request):
    """A broadcast update's arguments (update_weights_from_distributed); prepare takes the
    tensors' description, group_name and load_format."""

    POSITIONAL: ClassVar[tuple[str, ...]] = ("names", "dtypes", "shapes", "group_name",
                                             "flush_cache", "load_format")  # SGLang's order
    # A prepared update learns how it commits at commit_weight_update, not when it is received.
    COMMIT_FIELDS: ClassVar[tuple[str, ...]] = ("flush_cache", "weight_version", "pause_mode",
                                                "commit", "lora_name", "staging")

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True  # with commit=None: whether this call commits (resolve_commit)
    load_format: str | None = None  # None | "flattened_bucket": one buffer per dtype
    weight_version: str | None = None
    pause_mode: str = "retract"
    commit: bool | None = None
    lora_name: str | None = None  # the names are this adapter's PEFT tensors
    staging: str | None = None  # STAGING_MODES; None: the engine's weight_staging
    model: str | None = None  # the model updated (a frozen one must be named); None: the policy

    def __post_init__(self) -> None:  # JSON and Ray give lists; a trainer may give tuples
        object.__setattr__(self, "names", list(self.names))
        object.__setattr__(self, "dtypes", list(self.dtypes))
        object.__setattr__(self, "shapes", [list(s) for s in self.shapes])

    def tensors(self) -> tuple[list[str], list[str], list[list[int]]]:
        return self.names, self.dtypes, self.shapes

    def prepare_body(self) -> dict[str, Any]:
        """The arguments of prepare_weights_from_distributed for the same tensors."""
        return {k: v for k, v in self.body().items() if k not in self.COMMIT_FIELDS}


def _prompts(kind: str, value: Any) -> tuple[list[Any], bool]:
    """The prompts of a call and whether it gave one; shapes checked, contents are the
    engine's (tokenizer, vocabulary, chat template)."""
    if kind == "prompt":
        if isinstance(value, str):
            return [value], True
        if isinstance(value, list) and value and all(isinstance(p, str) for p in value):
            return list(value), False
        raise ValueError("prompt must be a non-empty str or a non-empty list of str")
    if kind == "input_ids":
        if _ids(value):
            return [list(value)], True
        if isinstance(value, list) and value and all(_ids(x) for x in value):
            return [list(x) for x in value], False
        raise ValueError("input_ids must be a non-empty list of int or a list of such lists")
    if _conversation(value):
        return [value], True
    if isinstance(value, list) and value and all(_conversation(c) for c in value):
        return list(value), False
    raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts, or a "
                     "list of such lists")


def _check_model(model: Any) -> None:
    if model is not None and (not isinstance(model, str) or not model):
        raise ValueError("model must be a non-empty string (a served model's name)")


def _ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def _conversation(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) for m in value)


def _listed(value: Any, count: int, name: str, kind: type | str, single: bool = False
            ) -> list[Any]:
    """A per-prompt field as a list of `count`: one value for all, or a list."""
    if kind == IMAGES:
        return _image_lists(value, count, single)
    if value is None or isinstance(value, kind):
        return [value] * count
    if isinstance(value, list) and len(value) == count and all(
            v is None or isinstance(v, kind) for v in value):
        return list(value)
    raise ValueError(f"{name} must be a {kind.__name__} or a list of {count} of them")


def _image_lists(value: Any, count: int, single: bool) -> list[list[Any] | None]:
    """image_data per prompt: for one prompt its images (a list, or one image); for a list of
    prompts a list of `count` entries, each None, one image or a list of images."""
    if value is None:
        return [None] * count
    if single:
        return [value if isinstance(value, list) else [value]]
    if not isinstance(value, list) or len(value) != count:
        raise ValueError(f"image_data must be a list of {count} entries (one per prompt: None, "
                         "an image or a list of images)")
    return [v if v is None or isinstance(v, list) else [v] for v in value]


def _map_images(value: Any, fn: Callable[[Any], Any]) -> Any:
    """image_data with every image replaced by fn(image), its lists kept."""
    if isinstance(value, list):
        return [None if v is None else _map_images(v, fn) for v in value]
    return fn(value)


def request_method(name: str, request_type: type[Request] = GenerateRequest, *,
                   drop: Iterable[str] = (), leading: tuple[inspect.Parameter, ...] = (),
                   trailing: tuple[inspect.Parameter, ...] = (),
                   asynchronous: bool = False, doc: str = "") -> Callable[..., Any]:
    """A public method `name` whose signature is `request_type`'s fields (less `drop`), after
    `leading` positional parameters and before `trailing` keyword-only ones. A call binds its
    arguments (TypeError as for any function), builds the request and returns
    `self._<name>(*leading, request, **trailing)`: implementations write only that method."""
    dropped = set(drop)
    own = [inspect.Parameter(
        f.name, inspect.Parameter.POSITIONAL_OR_KEYWORD if f.name in request_type.POSITIONAL
        else inspect.Parameter.KEYWORD_ONLY, annotation=f.type,
        default=inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default)
        for f in dataclasses.fields(request_type) if f.name not in dropped]
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    signature = inspect.Signature([self_param, *leading, *own, *trailing])
    first = [p.name for p in leading]
    last = [p.name for p in trailing]

    def arguments(args: tuple, kwargs: dict) -> tuple[Any, list[Any], dict[str, Any]]:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        values = dict(bound.arguments)
        impl = getattr(values.pop("self"), f"_{name}")
        lead = [values.pop(n) for n in first]
        trail = {n: values.pop(n) for n in last}
        return impl, [*lead, request_type(**values)], trail

    if asynchronous:
        async def method(*args: Any, **kwargs: Any) -> Any:
            impl, positional, keywords = arguments(args, kwargs)
            return await impl(*positional, **keywords)
    else:
        def method(*args: Any, **kwargs: Any) -> Any:
            impl, positional, keywords = arguments(args, kwargs)
            return impl(*positional, **keywords)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = inspect.cleandoc(doc) if doc else None
    method.__signature__ = signature  # type: ignore[attr-defined]
    return method


# The forms an image input takes (image_data, chat image parts): read here, decoded and
# preprocessed by the engine (engine/multimodal/image_processing.py).

def image_json(data: Any) -> str:
    """An image input as a string that travels as JSON to another engine: a PIL image as a
    PNG data: URL (lossless: it hashes the same there), bytes and local files as base64,
    other strings (data: URLs, base64) as they are."""
    if isinstance(data, Image.Image):
        buffer = io.BytesIO()
        (data if data.mode in PNG_MODES else data.convert("RGB")).save(buffer, format="PNG")
        return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    if isinstance(data, str) and not os.path.isfile(data.removeprefix("file://")):
        return data
    return base64.b64encode(image_bytes(data, "image_data")).decode()


def image_bytes(data: Any, field: str) -> bytes:
    """The encoded bytes of a non-PIL image input (ValueError naming `field`)."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    if isinstance(data, os.PathLike):
        return _read_file(os.fspath(data), field)
    if isinstance(data, dict):  # datasets' Image feature: {"bytes": ..., "path": ...}
        if data.get("bytes"):
            return bytes(data["bytes"])
        if data.get("path"):
            return _read_file(data["path"], field)
        raise ValueError(f"{field}: an image dict needs 'bytes' or 'path'")
    if not isinstance(data, str):
        raise ValueError(f"{field}: an image must be a PIL image, bytes, a base64 string, a "
                         f"data: URL or a local path, not {type(data).__name__}")
    if data.startswith("data:"):
        head, sep, payload = data.partition(",")
        if not sep or not head.endswith(";base64"):
            raise ValueError(f"{field}: a data: URL must be base64 (data:image/...;base64,...)")
        return _b64decode(payload, field)
    if data.startswith(("http://", "https://")):
        raise ValueError(f"{field}: image URLs are not fetched; send the image's bytes, base64 "
                         "or a data: URL")
    path = data.removeprefix("file://")
    if os.path.isfile(path):
        return _read_file(path, field)
    return _b64decode(data, field)


def _b64decode(text: str, field: str) -> bytes:
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"{field}: neither a local file nor valid base64 ({exc})") from exc


def _read_file(path: str, field: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"{field}: cannot read image file {path!r} ({exc})") from exc
