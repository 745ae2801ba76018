"""A multi-turn rollout with a calculator tool: tool output is masked, model tokens are not.

python examples/tool_agent.py
"""

from __future__ import annotations

from hotswap.engine import Engine
from hotswap.engine.models.fetch import ensure_model
from hotswap.rollout import TokenClient, ToolLoop

SYSTEM = ('You can call a calculator: write <tool_call>{"name": "calc", "arguments": '
          '{"expression": "2 * 3"}}</tool_call> and wait for the result.')


def calc(expression: str) -> str:
    if not set(expression) <= set("0123456789+-*/(). ") or "**" in expression:
        raise ValueError("only + - * / on numbers is allowed")
    return str(eval(expression))  # the character check above leaves only arithmetic


if __name__ == "__main__":
    with Engine(ensure_model(None), dtype="float32") as engine:
        client = TokenClient(engine, sampling={"temperature": 0.7, "max_new_tokens": 48})
        row = {"messages": [{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": "What is 17 * 23?"}]}
        for traj in ToolLoop({"calc": calc}, max_turns=3).run_group(client, row, 2, 0, seed=0):
            print(traj.finish_reason, traj.num_turns, "turns,", sum(traj.loss_mask), "of",
                  len(traj.loss_mask), "response tokens trainable")
            for m in traj.messages[2:]:
                print(f"  {m['role']}: {m['content']!r}")
