"""Write a random tiny MoE model folder (Qwen3-MoE or Mixtral) with SmolLM2's tokenizer and chat
template: an MoE policy for the GRPO job and routing-replay runs on CPU.

python examples/make_tiny_moe.py --out models/tiny-qwen3-moe [--arch qwen3_moe|mixtral] [--seed 0]
"""

from __future__ import annotations

import argparse
import os
import shutil

import torch
import transformers

from hotswap.engine.models.fetch import ensure_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")


def moe_config(arch: str, tokenizer: transformers.PreTrainedTokenizerBase,
               ) -> transformers.PretrainedConfig:
    """8 experts top-2, hidden 64, fp32; Qwen3-MoE has 3 layers with layer 1 dense."""
    common = dict(vocab_size=len(tokenizer), hidden_size=64, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_experts_per_tok=2,
                  max_position_embeddings=tokenizer.model_max_length,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
                  dtype="float32")
    if arch == "mixtral":
        return transformers.MixtralConfig(**common, intermediate_size=32, num_hidden_layers=2,
                                          num_local_experts=8)
    return transformers.Qwen3MoeConfig(**common, intermediate_size=96, moe_intermediate_size=32,
                                       num_hidden_layers=3, num_experts=8, norm_topk_prob=True,
                                       mlp_only_layers=[1])


def make_tiny_moe(out: str, arch: str = "qwen3_moe", seed: int = 0) -> str:
    """Save the random model (per-expert tensors, as save_pretrained writes them) and copy the
    tokenizer files of SmolLM2-135M-Instruct, converting that model first if it is missing."""
    source = ensure_model(None)
    tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(moe_config(arch, tokenizer),
                                                          dtype=torch.float32)
    with torch.no_grad():  # larger than the default init, so routes spread over the experts
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(source, name)):
            shutil.copy(os.path.join(source, name), os.path.join(out, name))
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder to write")
    parser.add_argument("--arch", choices=("qwen3_moe", "mixtral"), default="qwen3_moe")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(os.path.abspath(make_tiny_moe(args.out, args.arch, args.seed)))
