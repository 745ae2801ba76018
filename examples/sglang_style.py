"""verl / slime style: an SGLang Engine whose weights arrive in buckets, then a flush.

The trainer code is SGLang's; only the import changes. Buckets sent with flush_cache=False are
staged (generation held) and become one weight version at flush_cache().

python examples/sglang_style.py
"""

from __future__ import annotations

import torch
import transformers

from hotswap.engine.models.fetch import ensure_model
from hotswap.trainers_adapters import sglang as sgl  # instead of `import sglang as sgl`


def main() -> None:
    path = ensure_model()
    engine = sgl.Engine(model_path=path, random_seed=0)
    params = {"max_new_tokens": 16, "temperature": 0.0}
    prompt = "The capital of France is"
    print("before:", engine.generate(prompt, params)["text"])

    trainer = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():  # stand-in for a training step
        for p in trainer.parameters():
            p.mul_(1.01)
    named = list(trainer.named_parameters())
    for i in range(0, len(named), 32):  # verl's sgl_update_weights: one call per bucket
        bucket = [(n, p.detach()) for n, p in named[i:i + 32]]
        engine.update_weights_from_tensor(named_tensors=bucket, flush_cache=False)
    engine.flush_cache()  # verl and slime end an update with it: here it commits the buckets
    out = engine.generate(prompt, params, return_logprob=True)
    print("after: ", out["text"], "| version", out["meta_info"]["weight_version"],
          "| first logprob entry", out["meta_info"]["output_token_logprobs"][0])
    engine.shutdown()


if __name__ == "__main__":
    main()
