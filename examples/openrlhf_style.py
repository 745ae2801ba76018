"""OpenRLHF style: one tensor per update_weight call over a stateless group, one version at the end.

The trainer side keeps OpenRLHF's calls; the group helper's import changes and the engine actor
is hotswap's (here in this process, awaited directly; under Ray, `create_vllm_engines` from
hotswap.trainers_adapters.openrlhf makes the actors and the calls are `.remote(...)`).

python examples/openrlhf_style.py
"""

from __future__ import annotations

import asyncio
import socket

import torch
import transformers

from hotswap.engine.models.fetch import ensure_model
from hotswap.trainers_adapters.groups import stateless_init_process_group  # was openrlhf.utils
from hotswap.trainers_adapters.openrlhf import HotswapRolloutActor
from hotswap.trainers_adapters.vllm import SamplingParams


async def main() -> None:
    path = ensure_model()
    actor = HotswapRolloutActor(path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    joined = asyncio.create_task(actor.init_process_group("127.0.0.1", port, 1, 2, "openrlhf",
                                                          backend="gloo", use_ray=False))
    group = await asyncio.to_thread(stateless_init_process_group, "127.0.0.1", port, 0, 2, "cpu")
    await joined
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    params = list(model.named_parameters())
    for count, (name, param) in enumerate(params, start=1):  # broadcast_to_vllm
        received = asyncio.create_task(actor.update_weight(
            name, dtype=param.dtype, shape=param.shape, empty_cache=count == len(params)))
        await asyncio.to_thread(group.broadcast, param.data, 0, None)
        await received
    print(f"{len(params)} update_weight calls -> weight version", actor.get_weight_version())
    prompt_ids = actor.engine.tokenizer.encode("The capital of France is")
    out = await actor.generate(prompt_ids, SamplingParams(temperature=0.0, max_tokens=12,
                                                          logprobs=0))
    print(repr(out.outputs[0].text), "under version", out.outputs[0].weight_version)
    group.destroy()
    actor.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
