"""Vision-language rollouts: hotswap vs HF `generate` on image prompts, and the encoder's runs.

python bench/vlm.py [--prompts 8] [--samples 8] [--new-tokens 32] [--repeats 3] [--side 224]

No Qwen-VL checkpoint is reachable offline, so the bench writes one: a Qwen2.5-VL at a small but
real shape (decoder: 8 layers, hidden 384, 6 query / 2 KV heads; vision tower: 4 blocks of
width 256, windowed attention with blocks 1 and 3 full, 2x2 merge), seeded random weights, the
SmolLM2 tokenizer with Qwen's vision tokens and an image chat template, and Qwen2-VL's image
processor. The outputs mean nothing; the compute is a VL model's. Each prompt is a `shapes` row
(rollout/tasks.py) drawn at --side pixels (224: 64 image tokens) with its question, sampled
--samples times (a GRPO group: n=8), temperature 1, --new-tokens each (ignore_eos).
hotswap takes the rows in one generate call (image_data per prompt, n per prompt) from an empty
prefix cache; HF generates the same batch with num_return_sequences. Each repeat runs both, one
after the other; medians of tokens per second and their ratio are printed.
The vision encoder's runs (engine.get_load()["totals"]["encoder_runs"]) are counted per call:
once per image for its n samples, none when the same images come again under the same weights
(the encoder cache), once per image again after a weight update (a new version's features).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import transformers

from hotswap.engine import Engine
from hotswap.engine.models.fetch import ensure_model
from hotswap.rollout.grpo import shapes_rows

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# ChatML with image parts: an image renders as vision_start, one image_pad, vision_end
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def write_checkpoint(out: str, seed: int) -> str:
    """The bench's Qwen2.5-VL (shape in the module docstring), seeded, into `out`."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(ensure_model())
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    ids = dict(zip(["vision_start_token_id", "vision_end_token_id", "image_token_id",
                    "video_token_id"], tokenizer.convert_tokens_to_ids(VISION_TOKENS)))
    rope = {"rope_type": "default", "mrope_section": [8, 12, 12], "rope_theta": 10000.0}
    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=384, intermediate_size=1024,
                         num_hidden_layers=8, num_attention_heads=6, num_key_value_heads=2,
                         max_position_embeddings=4096, rope_parameters=rope,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id),
        vision_config=dict(depth=4, hidden_size=256, intermediate_size=512, num_heads=4,
                           out_hidden_size=384, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1, 3]),
        **ids)
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    transformers.Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2,
                                          min_pixels=56 * 56, max_pixels=448 * 448
                                          ).save_pretrained(out)
    return out


def prompts(path: str, count: int, side: int, seed: int, system: str | None = None
            ) -> tuple[list[list[int]], list]:
    """`count` shapes rows redrawn at `side` pixels: their chat ids (one placeholder per image;
    after a system message when given) and their images."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    ids, images = [], []
    for row in shapes_rows(count, seed):
        part = row["messages"][0]["content"][0]  # the image part, then the question
        image = part["image"] = part["image"].resize((side, side))
        chat = [{"role": "system", "content": system}] * bool(system) + row["messages"]
        ids.append(list(tokenizer.apply_chat_template(chat, tokenize=True,
                                                      add_generation_prompt=True)["input_ids"]))
        images.append(image)
    return ids, images


def hotswap_run(engine: Engine, ids: list[list[int]], images: list, params: dict,
                flush: bool = True) -> tuple[float, int, int]:
    """Seconds, generated tokens and encoder runs of one generate call over every prompt, from
    an empty cache (prefixes and image features) unless flush is False."""
    runs = engine.get_load()["totals"]["encoder_runs"]
    if flush:
        engine.flush_cache()
    start = time.perf_counter()
    outs = engine.generate(input_ids=ids, image_data=[[im] for im in images],
                           sampling_params=params, return_logprob=True)
    seconds = time.perf_counter() - start
    tokens = sum(len(o["output_ids"]) for o in outs)
    return seconds, tokens, engine.get_load()["totals"]["encoder_runs"] - runs


@torch.no_grad()
def hf_run(model, engine: Engine, ids: list[list[int]], images: list, samples: int,
           new_tokens: int) -> tuple[float, int]:
    """Seconds and generated tokens of HF generate over the same batch (the prompts are the
    same length: the images are the same size), n samples each; the pixels come from HF's
    image processor beforehand and the expanded ids from the engine, so both sides time the
    model only."""
    image_token = engine.model_config.image_token_id
    pixels = transformers.AutoImageProcessor.from_pretrained(engine.config.model_path)(
        images=images, return_tensors="pt")
    expanded = [engine.generate(input_ids=p, image_data=[im], sampling_params={
        "max_new_tokens": 1})["meta_info"]["prompt_ids"] for p, im in zip(ids, images)]
    input_ids = torch.tensor(expanded)
    start = time.perf_counter()
    out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                         pixel_values=pixels["pixel_values"],
                         image_grid_thw=pixels["image_grid_thw"],
                         mm_token_type_ids=(input_ids == image_token).int(), do_sample=True,
                         temperature=1.0, top_k=0, num_return_sequences=samples,
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    seconds = time.perf_counter() - start
    return seconds, (out.shape[1] - input_ids.shape[1]) * out.shape[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=8, help="per prompt (a GRPO group)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--side", type=int, default=224, help="image side in pixels")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    transformers.logging.set_verbosity_error()
    params = {"n": args.samples, "temperature": 1.0, "max_new_tokens": args.new_tokens,
              "ignore_eos": True}
    with tempfile.TemporaryDirectory(prefix="hotswap-vlm-") as folder:
        path = write_checkpoint(folder, args.seed)
        ids, images = prompts(path, args.prompts, args.side, args.seed)
        hf = transformers.AutoModelForImageTextToText.from_pretrained(
            path, dtype=torch.float32).eval()
        engine = Engine(path, dtype="float32", seed=args.seed, max_total_tokens=32768)
        try:
            hotswap_run(engine, ids[:1], images[:1], params)  # warm-up
            seen = engine.generate(input_ids=ids[0], image_data=[images[0]],
                                   sampling_params={"max_new_tokens": 1})["meta_info"]
            print(f"{args.prompts} prompts x {args.samples} samples x {args.new_tokens} tokens, "
                  f"one {args.side}px image each ({seen['images'][0]['tokens']} image tokens, "
                  f"{len(seen['prompt_ids'])} prompt tokens), torch threads "
                  f"{torch.get_num_threads()}")
            ours, theirs = [], []
            for repeat in range(args.repeats):
                seconds, tokens, runs = hotswap_run(engine, ids, images, params)
                ref_seconds, ref_tokens = hf_run(hf, engine, ids, images, args.samples,
                                                 args.new_tokens)
                ours.append(tokens / seconds)
                theirs.append(ref_tokens / ref_seconds)
                print(f"repeat {repeat}: hotswap {ours[-1]:.0f} tok/s, HF {theirs[-1]:.0f} "
                      f"tok/s, ratio {ours[-1] / theirs[-1]:.2f}x; encoder runs {runs}")
            # the same images after other text: no prefix is shared, the features are
            other, _ = prompts(path, args.prompts, args.side, args.seed, system="Count well.")
            runs_again = hotswap_run(engine, other, images, params, flush=False)[2]
            named = [(n, p.detach()) for n, p in hf.named_parameters()]
            assert engine.update_weights_from_tensor(named, weight_version="1")["success"]
            runs_updated = hotswap_run(engine, ids, images, params, flush=False)[2]
        finally:
            engine.shutdown()
    ratio = statistics.median(ours) / statistics.median(theirs)
    print(f"median: hotswap {statistics.median(ours):.0f} tok/s, HF "
          f"{statistics.median(theirs):.0f} tok/s: {ratio:.2f}x (goal >= 3x)")
    print(f"encoder runs per call of {args.prompts} images x {args.samples} samples: from "
          f"an empty cache {runs} (expected {args.prompts}), the same images under the same "
          f"weights {runs_again} (expected 0: cached), after a weight update {runs_updated} "
          f"(expected {args.prompts})")


if __name__ == "__main__":
    main()
