"""A hotswap OpenRLHF rollout actor in its own process, reachable through hotswap.weight_sync.rpc.

It stands in for the Ray actor process OpenRLHF starts per vLLM engine: argv is the model path;
it prints one JSON line with the RPC address and key, then serves until stdin closes.
"""

from __future__ import annotations

import json
import sys

from hotswap.trainers_adapters.openrlhf import HotswapRolloutActor
from hotswap.weight_sync.rpc import RpcServer

METHODS = ("init_process_group", "update_weight", "reset_prefix_cache", "pause_generation",
           "resume_generation", "generate_ids", "get_weight_version", "sleep", "wake_up")


class Actor(HotswapRolloutActor):
    def generate_ids(self, prompt_token_ids: list[int], max_tokens: int) -> dict:
        """generate() with OpenRLHF's arguments, reduced to what crosses the RPC as plain data."""
        from hotswap.trainers_adapters.vllm import SamplingParams

        out = self.generate(prompt_token_ids, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                             ignore_eos=True, logprobs=0))
        sample = out.outputs[0]
        return {"token_ids": sample.token_ids, "version": sample.weight_version,
                "logprobs": [next(iter(lp.values())).logprob for lp in sample.logprobs]}


def main() -> None:
    actor = Actor(sys.argv[1], max_total_tokens=2048)
    with RpcServer(actor, exposed=METHODS) as server:
        print(json.dumps({"address": list(server.address), "authkey": server.authkey.hex()}),
              flush=True)
        sys.stdin.read()
    actor.shutdown()


if __name__ == "__main__":
    main()
