"""RequestBuilder: turns the arguments of Engine.generate into validated, tokenized Reqs.

Everything is checked and tokenized before anything is submitted, so one bad prompt in a batch
raises ValueError and no request of that batch runs.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hotswap.engine.client.protocol import per_prompt
from hotswap.engine.core.request import Req
from hotswap.engine.core.sampling_params import SamplingParams
from hotswap.engine.grammar.manager import GrammarManager


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

    def build(self, prompt: Any, input_ids: Any, messages: Any, sampling_params: Any,
              return_logprob: bool, top_logprobs_num: int, lora_name: Any,
              cache_salt: Any, rid: Any, stream: bool, return_routed_experts: bool = False,
              session_id: Any = None) -> tuple[list[Req], bool]:
        """Validate and tokenize everything first: a bad input raises before anything runs."""
        self.check_servable()
        prompts, single = self._prompt_ids(prompt, input_ids, messages)
        count = len(prompts)
        params = per_prompt(sampling_params, count, "sampling_params", dict)
        salts = per_prompt(cache_salt, count, "cache_salt", str)
        loras = per_prompt(lora_name, count, "lora_name", str)
        rids = per_prompt(rid, count, "rid", str)
        sessions = per_prompt(session_id, count, "session_id", str)
        if not isinstance(top_logprobs_num, int) or not 0 <= top_logprobs_num <= 100:
            raise ValueError("top_logprobs_num must be an integer in [0, 100]")
        if not isinstance(return_routed_experts, bool):
            raise ValueError("return_routed_experts must be a bool")
        if return_routed_experts and not self.routed_experts:
            raise ValueError("return_routed_experts needs an MoE model served with "
                             "enable_return_routed_experts=True (server: "
                             "--enable-return-routed-experts)")
        if len(set(r for r in rids if r is not None)) < sum(r is not None for r in rids):
            raise ValueError("rid values must be unique")
        reqs = []
        for ids, p, salt, lora, r, session in zip(prompts, params, salts, loras, rids, sessions):
            sp = SamplingParams.from_dict(p)
            self._check_request(ids, sp, lora)
            self._check_session(session, sp)
            grammar_job = self.grammars.request_grammar(sp)  # ValueError if bad
            base = r or uuid.uuid4().hex
            leader = None
            for k in range(sp.n):
                reqs.append(Req(
                    rid=base if sp.n == 1 else f"{base}-{k}", prompt_ids=ids,
                    params=sp.for_sample(k), return_logprob=return_logprob,
                    top_logprobs_num=top_logprobs_num,
                    return_routed_experts=return_routed_experts, cache_salt=salt, lora_name=lora,
                    stream=stream, group_leader=leader, created=time.perf_counter(),
                    grammar=self.grammars.for_sample(grammar_job), session_id=session))
                leader = leader or reqs[-1]
        return reqs, single and len(reqs) == 1

    def _prompt_ids(self, prompt: Any, input_ids: Any, messages: Any
                    ) -> tuple[list[list[int]], bool]:
        given = [x is not None for x in (prompt, input_ids, messages)]
        if sum(given) != 1:
            raise ValueError("give exactly one of prompt, input_ids, messages")
        if prompt is not None:
            if isinstance(prompt, str):
                return [self._encode(prompt)], True
            if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
                return [self._encode(p) for p in prompt], False
            raise ValueError("prompt must be a non-empty str or a non-empty list of str")
        if input_ids is not None:
            if isinstance(input_ids, list) and input_ids and all(
                    isinstance(t, int) for t in input_ids):
                return [list(input_ids)], True
            if isinstance(input_ids, list) and input_ids and all(
                    isinstance(x, list) and all(isinstance(t, int) for t in x)
                    for x in input_ids):
                return [list(x) for x in input_ids], False
            raise ValueError("input_ids must be a non-empty list of int or a list of such lists")
        if isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages):
            return [self._chat(messages)], True
        if isinstance(messages, list) and messages and all(
                isinstance(c, list) and c and all(isinstance(m, dict) for m in c)
                for c in messages):
            return [self._chat(c) for c in messages], False
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts, "
                         "or a list of such lists")

    def _encode(self, text: str) -> list[int]:
        if not text:
            raise ValueError("prompt is empty")
        return self.tokenizer.encode(text)

    def _chat(self, conversation: list[dict]) -> list[int]:
        for m in conversation:
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError("each message needs a string 'role' and a string 'content'")
        if self.tokenizer.chat_template is None:
            raise ValueError("this model's tokenizer has no chat template; use prompt=")
        ids = self.tokenizer.apply_chat_template(conversation, tokenize=True,
                                                 add_generation_prompt=True)
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
        sp.check_vocab(vocab)
        self.check_lora(lora)
