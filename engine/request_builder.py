"""RequestBuilder: turns the arguments of Engine.generate (and classify) into validated,
tokenized Reqs.

Everything is checked and tokenized before anything is submitted, so one bad prompt in a batch
raises ValueError and no request of that batch runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hotswap.engine.client.protocol import check_request_model
from hotswap.engine.client.request import ClassifyRequest, GenerateRequest
from hotswap.engine.config import ModelConfig
from hotswap.engine.core.request import Req, Scoring
from hotswap.engine.core.sampling_params import SamplingParams
from hotswap.engine.grammar.manager import GrammarManager
from hotswap.engine.multimodal.image_processing import ImageProcessorConfig
from hotswap.engine.multimodal.prompt_images import PromptImages, prompt_images


@dataclass(frozen=True)
class RequestBuilder:
    tokenizer: Any
    vocab_size: int
    context_length: int
    grammars: GrammarManager
    kv_tokens: Callable[[], int]  # the KV pool's size now (a TP pool may be rebuilt)
    check_servable: Callable[[], None]  # raises while the weights are incomplete or a worker died
    check_lora: Callable[[str | None], None]
    session_known: Callable[[str], bool]
    routed_experts: bool = False  # the engine may return routed experts (an MoE model)
    num_labels: int = 0  # a reward model's classes; 0: the model generates
    model_name: str = ""  # the served model's name: a request naming another is refused
    model_config: ModelConfig | None = None  # a vision-language model takes images
    image_processor: ImageProcessorConfig | None = None  # and preprocesses them so

    def build(self, request: GenerateRequest) -> tuple[list[Req], bool]:
        """Validate and tokenize everything first: a bad input raises before anything runs.
        One Req per (prompt, sample); whether the call gave a single prompt with n=1."""
        check_request_model(self.model_name, request.model)
        if self.num_labels:
            raise ValueError("this is a reward model (a *ForSequenceClassification or "
                             "*ForTokenClassification checkpoint): it scores, it does not "
                             "generate; call classify")
        self.check_servable()
        rows, single = request.split()
        if request.return_routed_experts and not self.routed_experts:
            raise ValueError("return_routed_experts needs an MoE model served with "
                             "enable_return_routed_experts=True (server: "
                             "--enable-return-routed-experts)")
        reqs = []
        for row in rows:
            ids, images = self._prompt_images(row)
            sp = SamplingParams.from_dict(row.sampling_params)
            self._check_request(ids, sp, row.lora_name)
            self._check_session(row.session_id, sp)
            grammar_job = self.grammars.request_grammar(sp)  # ValueError if bad
            leader = None
            for k in range(sp.n):
                reqs.append(Req(
                    rid=row.rid if sp.n == 1 else f"{row.rid}-{k}", prompt_ids=ids,
                    params=sp.for_sample(k),
                    return_logprob=request.return_logprob,
                    top_logprobs_num=request.top_logprobs_num,
                    return_routed_experts=request.return_routed_experts,
                    cache_salt=row.cache_salt, lora_name=row.lora_name, stream=request.stream,
                    group_leader=leader, created=time.perf_counter(),
                    grammar=self.grammars.for_sample(grammar_job), session_id=row.session_id,
                    images=images))
                leader = leader or reqs[-1]
        return reqs, single and len(reqs) == 1

    def build_classify(self, request: ClassifyRequest) -> tuple[list[Req], bool]:
        """classify's Reqs, one per prompt, everything checked first; whether the call gave a
        single prompt."""
        check_request_model(self.model_name, request.model)
        if not self.num_labels:
            raise ValueError("classify needs a reward model (a *ForSequenceClassification or "
                             "*ForTokenClassification checkpoint); this model generates")
        self.check_servable()
        rows, single = request.split()
        classes = request.returned_token_ids
        if classes is not None and max(classes) >= self.num_labels:
            raise ValueError(f"returned_token_ids must be class indices in [0, "
                             f"{self.num_labels}), got {max(classes)}")
        scoring = Scoring(request.activation, request.per_token, request.step_tag_id,
                          None if classes is None else tuple(classes))
        idle = SamplingParams(max_new_tokens=0)
        reqs = []
        for row in rows:
            ids = self._prompt_ids(row, generation_prompt=False)
            self._check_ids(ids)
            reqs.append(Req(rid=row.rid, prompt_ids=ids, params=idle, cache_salt=row.cache_salt,
                            scoring=scoring, created=time.perf_counter()))
        return reqs, single

    def _prompt_images(self, row: GenerateRequest) -> tuple[list[int], PromptImages | None]:
        """A row's prompt ids, image placeholders expanded, and its images."""
        images = row.image_data
        if row.kind == "messages":
            if images is not None:
                raise ValueError("image_data: with messages, images go in the messages' "
                                 "content parts ({'type': 'image_url', ...})")
            images = message_images(row.messages)
        return prompt_images(self._prompt_ids(row), images, self.model_config,
                             self.image_processor, row.kind)

    def _prompt_ids(self, row: GenerateRequest | ClassifyRequest,
                    generation_prompt: bool = True) -> list[int]:
        if row.kind == "prompt":
            return self._encode(row.prompt)
        if row.kind == "input_ids":
            return list(row.input_ids)
        return self._chat(row.messages, generation_prompt)

    def _encode(self, text: str) -> list[int]:
        if not text:
            raise ValueError("prompt is empty")
        return self.tokenizer.encode(text)

    def _chat(self, conversation: list[dict], generation_prompt: bool) -> list[int]:
        for m in conversation:
            if not isinstance(m.get("role"), str) or not _content(m.get("content")):
                raise ValueError("each message needs a string 'role' and a 'content' that is a "
                                 "string or a list of {'type': 'text' | 'image_url' | 'image'} "
                                 "parts")
        if self.tokenizer.chat_template is None:
            raise ValueError("this model's tokenizer has no chat template; use prompt=")
        ids = self.tokenizer.apply_chat_template(template_messages(conversation), tokenize=True,
                                                 add_generation_prompt=generation_prompt)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def _check_session(self, session: str | None, sp: SamplingParams) -> None:
        if session is None:
            return
        if not self.session_known(session):
            raise ValueError(f"session_id {session!r}: no such session is open (open_session; "
                             "closed and expired sessions are gone)")
        if sp.n != 1:
            raise ValueError("session_id: a session is one conversation; n must be 1")

    def _check_request(self, ids: list[int], sp: SamplingParams, lora: str | None) -> None:
        self._check_ids(ids)
        sp.check_vocab(self.vocab_size)
        self.check_lora(lora)

    def _check_ids(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"input_ids must be in [0, {vocab}), got {min(ids)}..{max(ids)}")
        context = self.context_length
        if len(ids) >= context:
            raise ValueError(f"prompt has {len(ids)} tokens; the context length is {context}")
        if len(ids) + 1 > self.kv_tokens():
            raise ValueError(f"prompt has {len(ids)} tokens; the KV pool holds "
                             f"{self.kv_tokens()}")


IMAGE_PARTS = ("image_url", "image")


def _content(content: Any) -> bool:
    return isinstance(content, str) or (isinstance(content, list) and all(
        isinstance(p, dict) and (p.get("type") == "text" and isinstance(p.get("text"), str)
                                 or p.get("type") in IMAGE_PARTS) for p in content))


def message_images(conversation: list[dict]) -> list[Any]:
    """The images of a conversation's content parts, in order: an image_url part's url (a
    data: URL; nothing is fetched), an image part's image (any form image_data takes)."""
    images = []
    for m in conversation:
        for part in m["content"] if isinstance(m.get("content"), list) else ():
            if part.get("type") == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str):
                    raise ValueError("messages: an image_url part needs {'url': 'data:...'}")
                images.append(url)
            elif part.get("type") == "image":
                if part.get("image") is None:
                    raise ValueError("messages: an image part needs 'image' (the image)")
                images.append(part["image"])
    return images


def template_messages(conversation: list[dict]) -> list[dict]:
    """The conversation as chat templates read it: image parts as {'type': 'image'} (the
    template writes the placeholder; the image itself travels apart)."""
    return [m if isinstance(m["content"], str) else {**m, "content": [
        {"type": "image"} if p["type"] in IMAGE_PARTS else p for p in m["content"]]}
        for m in conversation]
