"""The scoring routes (engine/server/scoring_routes.py, docs/api.md#scoring-over-http): each
trainer's payload as its code builds it, scored by a tiny random Llama reward model and compared
with HF's AutoModelForSequenceClassification in float32."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
import transformers
from fixtures import API_KEY, serve, write_reward_model

from hotswap.engine import Engine

ATOL = 1e-4
LABELS = {"0": "rejected", "1": "chosen"}
CHATS = [
    [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}],
    [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "5, sure."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."},
     {"role": "assistant", "content": "Blue"}],
]


@pytest.fixture(scope="module")
def reward(tmp_path_factory):
    """(engine, HF model, tokenizer) of a 2-class Llama reward model with named labels."""
    path = str(tmp_path_factory.mktemp("scoring_rm"))
    model = write_reward_model(path, "llama", 2, 0)
    with open(f"{path}/config.json") as f:
        cfg = json.load(f)
    cfg["id2label"], cfg["label2id"] = LABELS, {v: int(k) for k, v in LABELS.items()}
    with open(f"{path}/config.json", "w") as f:
        json.dump(cfg, f)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    with Engine(path, device="cpu", dtype="float32", max_total_tokens=4096) as engine:
        yield engine, model, tokenizer


@pytest.fixture(scope="module")
def client(reward):
    with serve(reward[0]) as server, httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@torch.no_grad()
def hf_scores(reward, text: str | None = None, ids: list[int] | None = None) -> torch.Tensor:
    """HF's logits for one unpadded sequence (its last token), from text or ids."""
    _, model, tokenizer = reward
    ids = tokenizer(text).input_ids if ids is None else ids
    return model(torch.tensor([ids])).logits[0]


def templated(tokenizer, chat: list[dict]) -> str:
    """verl's RewardLoopWorker._preprocess_reward_inputs: the RM's chat template as text, with
    no generation prompt, a leading bos removed."""
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=False, tokenize=False)
    bos = tokenizer.bos_token
    return text[len(bos):] if bos is not None and text.startswith(bos) else text


def chat_ids(tokenizer, chat: list[dict]) -> list[int]:
    """The reward model's chat template, tokenized (no generation prompt)."""
    return tokenizer.apply_chat_template(chat, add_generation_prompt=False, tokenize=True,
                                         return_dict=False)


def close(got, want) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float32), want, atol=ATOL, rtol=0)


# verl/experimental/reward_loop/reward_loop.py, RewardLoopWorker.compute_score_disrm with
# reward_model.rollout.name == "vllm": POST classify, read data[-1]["probs"][-1]. Its versions
# send "activation" (vLLM < 0.11.2), then "add_special_tokens" too, now "use_activation".
VERL_VLLM_OPTIONS = [{"activation": False}, {"activation": False, "add_special_tokens": False},
                     {"use_activation": False}]


@pytest.mark.parametrize("options", VERL_VLLM_OPTIONS)
def test_verl_vllm_reward_loop_payload(reward, client, options):
    engine, _, tokenizer = reward
    for chat in CHATS:
        prompt = templated(tokenizer, chat)
        payloads = {"model": engine.config.model_path, "input": prompt, **options}
        output = client.post("/classify", json=payloads).json()
        rm_score = output["data"][-1]["probs"][-1]
        special = options.get("add_special_tokens", True)
        ids = tokenizer(prompt, add_special_tokens=special).input_ids
        assert rm_score == pytest.approx(hf_scores(reward, ids=ids)[-1].item(), abs=ATOL)


def test_verl_sglang_reward_loop_payload(reward, client):
    # The same function with reward_model.rollout.name == "sglang": POST v1/embeddings, read
    # data[-1]["embedding"][-1].
    engine, _, tokenizer = reward
    prompt = templated(tokenizer, CHATS[1])
    payloads = {"model": engine.config.model_path, "input": prompt}
    output = client.post("/v1/embeddings", json=payloads).json()
    rm_score = output["data"][-1]["embedding"][-1]
    assert rm_score == pytest.approx(hf_scores(reward, prompt)[-1].item(), abs=ATOL)
    assert output["object"] == "list" and output["data"][0]["object"] == "embedding"
    assert output["usage"]["prompt_tokens"] == len(tokenizer(prompt).input_ids)


def test_openrlhf_remote_rm_payload(reward, client):
    # openrlhf/utils/remote_rm_utils.py, remote_rm_fn_ray -> request_api_wrapper: POST
    # {"query", "prompts", "labels"}; reads "rewards" (and "scores", "extra_logs").
    _, _, tokenizer = reward
    prompts = [tokenizer.apply_chat_template(c[:-1], add_generation_prompt=True, tokenize=False)
               for c in CHATS]
    queries = [p + c[-1]["content"] + tokenizer.eos_token for p, c in zip(prompts, CHATS)]
    labels = ["4", "4", None]
    response = client.post("/get_reward", json={"query": queries, "prompts": prompts,
                                                 "labels": labels}).json()
    want = torch.stack([hf_scores(reward, q)[-1] for q in queries])
    close(response["rewards"], want)
    assert response["scores"] == response["rewards"] and response["extra_logs"] == {}
    # With more servers than queries, RemoteRewardModel.get_rewards sends a server none.
    empty = client.post("/get_reward", json={"query": [], "prompts": [], "labels": []})
    assert empty.json() == {"rewards": [], "scores": [], "extra_logs": {}}


def test_slime_remote_rm_payload(reward, client):
    # slime/rollout/rm_hub/__init__.py, remote_rm: POST {"prompt", "response", "label"} per
    # sample as it finishes (many at once); the reward is the response body itself.
    _, _, tokenizer = reward
    samples = []
    for chat in CHATS:
        text = tokenizer.apply_chat_template(chat[:-1], add_generation_prompt=True,
                                             tokenize=False)
        samples.append({"prompt": text, "response": chat[-1]["content"], "label": "4"})
        samples.append({"prompt": chat[:-1], "response": chat[-1]["content"], "label": None})
    with ThreadPoolExecutor(len(samples)) as pool:
        rewards = list(pool.map(lambda p: client.post("/get_reward", json=p).json(), samples))
    for sample, got in zip(samples, rewards, strict=True):
        if isinstance(sample["prompt"], str):
            want = hf_scores(reward, sample["prompt"] + sample["response"])[-1]
        else:
            chat = [*sample["prompt"], {"role": "assistant", "content": sample["response"]}]
            want = hf_scores(reward, ids=chat_ids(tokenizer, chat))[-1]
        assert isinstance(got, float)
        assert got == pytest.approx(want.item(), abs=ATOL)


def test_vllm_classify_shape(reward, client):
    # vllm/entrypoints/pooling/classify/protocol.py: ClassificationRequest (completion and chat
    # forms) and ClassificationResponse.
    engine, _, tokenizer = reward
    texts = [templated(tokenizer, c) for c in CHATS]
    got = client.post("/v1/classify", json={"model": os.path.basename(engine.config.model_path),
                                            "input": texts}).json()
    want = torch.stack([hf_scores(reward, t) for t in texts])
    assert got["object"] == "list" and got["id"].startswith("classify-")
    assert got["model"] == os.path.basename(engine.config.model_path)
    assert [d["index"] for d in got["data"]] == [0, 1, 2]
    close([d["probs"] for d in got["data"]], want.softmax(-1))  # vLLM's default activation
    assert [d["label"] for d in got["data"]] == [LABELS[str(i)] for i in want.argmax(-1).tolist()]
    assert {d["num_classes"] for d in got["data"]} == {2}
    tokens = sum(len(tokenizer(t).input_ids) for t in texts)
    assert got["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens,
                            "completion_tokens": 0, "prompt_tokens_details": None}
    ids = tokenizer(texts[0]).input_ids
    raw = client.post("/v1/classify", json={"input": ids, "use_activation": False}).json()
    close(raw["data"][0]["probs"], hf_scores(reward, ids=ids))
    cut = client.post("/v1/classify", json={"input": [ids], "truncate_prompt_tokens": 5,
                                            "add_special_tokens": False}).json()
    close(cut["data"][0]["probs"], hf_scores(reward, ids=ids[-5:]).softmax(-1))
    chat = client.post("/classify", json={"messages": CHATS[2], "activation": False}).json()
    close(chat["data"][0]["probs"], hf_scores(reward, ids=chat_ids(tokenizer, CHATS[2])))


def test_sglang_native_classify_shape(reward, client):
    # python/sglang/srt/entrypoints/http_server.py, classify_request: an EmbeddingReqInput in,
    # {"embedding", "meta_info"} out (a list for a list).
    _, _, tokenizer = reward
    texts = [templated(tokenizer, c) for c in CHATS[:2]]
    batch = client.post("/classify", json={"text": texts}).json()
    assert isinstance(batch, list) and len(batch) == 2
    for text, out in zip(texts, batch, strict=True):
        close(out["embedding"], hf_scores(reward, text))  # raw scores, as SGLang returns them
        assert out["meta_info"]["prompt_tokens"] == len(tokenizer(text).input_ids)
    ids = tokenizer(texts[0]).input_ids
    one = client.post("/classify", json={"input_ids": ids, "rid": "r1"}).json()
    assert one["meta_info"]["id"] == "r1"
    close(one["embedding"], hf_scores(reward, ids=ids))


GOOD = ("/v1/embeddings", {"input": "Hello there"})
BAD = [
    ("/v1/classify", {"input": []}, "input"),
    ("/v1/classify", {"input": ""}, "input"),
    ("/v1/classify", {"input": [[1, -2]]}, "input"),
    ("/v1/classify", {"input": [1, 2], "activation": "yes"}, "activation"),
    ("/v1/classify", {"input": "hi", "messages": CHATS[0]}, "exactly one of input and messages"),
    ("/v1/classify", {"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/classify", {"input": "hi", "dimensions": 3}, "dimensions"),
    ("/v1/classify", {"input": [5, 10 ** 6]}, "input_ids must be in"),
    ("/classify", {"text": ["ok", 3]}, "sglang.text"),
    ("/classify", {"text": "hi", "input_ids": [1]}, "exactly one of text and input_ids"),
    ("/v1/embeddings", {"input": "hi", "encoding_format": "base64"}, "encoding_format"),
    ("/v1/embeddings", {"model": "someone-else", "input": "hi"}, "is not served here"),
    ("/get_reward", {"query": [""]}, "openrlhf.query.0"),
    ("/get_reward", {"query": ["a", "b"], "prompts": ["a"]}, "prompts: 1 entries for 2"),
    ("/get_reward", {"prompt": "a", "label": "x"}, "slime.response"),
    ("/get_reward", {"prompt": [{"role": "user"}], "response": "r"}, "string 'role' and"),
]


@pytest.mark.parametrize(("path", "body", "says"), BAD)
def test_malformed_requests_400_and_the_server_serves_on(reward, client, path, body, says):
    r = client.post(path, json=body)
    assert r.status_code == (404 if "not served" in says else 400), r.text
    assert says in r.json()["error"]["message"]
    good = client.post(GOOD[0], json=GOOD[1])
    close(good.json()["data"][0]["embedding"], hf_scores(reward, GOOD[1]["input"]))
    reward[0].check_integrity()


def test_a_generating_model_refuses_scoring(api_server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for path, body in [("/v1/classify", {"input": "hi"}), ("/classify", {"text": "hi"}),
                       ("/v1/embeddings", {"input": "hi"}),
                       ("/get_reward", {"query": ["hi"]})]:
        r = httpx.post(f"{api_server.url}{path}", json=body, headers=headers, timeout=30)
        assert r.status_code == 400
        assert "classify needs a reward model" in r.json()["error"]["message"]
    generated = httpx.post(f"{api_server.url}/generate", headers=headers, timeout=30, json={
        "text": "Hello", "sampling_params": {"max_new_tokens": 2}})
    assert generated.status_code == 200
