"""A program: one answer, forked into 4 follow-ups that share its KV, then a select.

python examples/program_fork.py
"""

from __future__ import annotations

from hotswap.engine import Engine
from hotswap.engine.models.fetch import ensure_model
from hotswap.rollout import TokenClient, assistant, function, gen, select, system, user


@function
def review(s, question):
    s += system("Answer briefly.") + user(question) + assistant(gen("answer", max_new_tokens=24))
    s += user("Is that answer correct?") + assistant(select("verdict", ["Yes", "No"]))
    branches = s.fork(4)
    branches += user("Give one more example.") + assistant(gen("more", max_new_tokens=16))
    s.variables["branches"] = branches


if __name__ == "__main__":
    with Engine(ensure_model(None), dtype="float32") as engine:
        client = TokenClient(engine, sampling={"temperature": 0.8})
        (s,) = review.run_batch([{"question": "Name a mammal that lives in the sea."}],
                                client=client)
        print("answer:", s["answer"], "| verdict:", s["verdict"], s["verdict_scores"])
        for b in s["branches"]:
            print(f"  cached {b.cached_tokens - s.cached_tokens:3d} tokens | {b['more']!r}")
