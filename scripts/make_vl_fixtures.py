#!/usr/bin/env python3
"""Writes tests/fixtures/qwen3_vl_images/ and qwen3_vl_moe_images/: a tiny
random Qwen3-VL (dense text model) and Qwen3-VL-MoE (its fused experts
stored as the hub ships them, [E, in, out]), each with a vision tower of
three blocks and deepstack mergers after the first and the last, their
preprocessor_config.json, two PNG images of different sizes, and what
transformers computes from them:
vision.json holds, per image, the patch grid, the merged rows and the
deepstack rows of the tower (`model.visual`), in float32 over the
bf16-rounded weights; expected_images.json, prompts of text and one or
both images with their greedy continuation: the prompt as parts (ids, or an
image file), the prompt's ids as transformers' processor expands them, and
a logits row per generated id (row 0 the prompt's last position, row i
after feeding generated id i - 1), and the outputs of every layer but the
last at every prompt position (transformers' hidden states, taken before
the deepstack rows are added).

  python scripts/make_vl_fixtures.py [--out tests/fixtures]

Needs torch, transformers, Pillow and numpy; seeds are fixed.
"""
import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers
from PIL import Image
from transformers import AutoConfig
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from make_fixtures import qwen3_vl_ids, transpose_experts

VOCAB = 230
CONFIG = dict(
    text_config=dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-6, vocab_size=VOCAB, max_position_embeddings=256,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                             mrope_section=[2, 3, 3], mrope_interleaved=True),
        tie_word_embeddings=False,
    ),
    vision_config=dict(
        depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=8,
        spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
        num_position_embeddings=36, deepstack_visual_indexes=[0, 2],
        hidden_act="gelu_pytorch_tanh",
    ),
    tie_word_embeddings=False,
    **qwen3_vl_ids(VOCAB),
)
MOE_TEXT = dict(CONFIG["text_config"], model_type="qwen3_vl_moe_text", num_experts=6, num_experts_per_tok=2,
                moe_intermediate_size=40, decoder_sparse_step=1, mlp_only_layers=[1])
MODELS = {
    "qwen3_vl_images": ("qwen3_vl", transformers.Qwen3VLForConditionalGeneration, CONFIG),
    "qwen3_vl_moe_images": ("qwen3_vl_moe", transformers.Qwen3VLMoeForConditionalGeneration,
                            dict(CONFIG, text_config=MOE_TEXT)),
}
PROCESSOR = dict(patch_size=8, temporal_patch_size=2, merge_size=2,
                 image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
                 size=dict(shortest_edge=16 * 16, longest_edge=48 * 80))
IMAGES = {"wide.png": (37, 61), "tall.png": (90, 45)}


def randomize(model, seed):
    """Matrices scaled by their fan-in, norm weights near 1, biases and the
    position table of either sign; then bf16-rounded (the GPU sees bf16)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif p.dim() == 1:
                p.copy_(torch.empty(p.shape).uniform_(0.5, 1.5, generator=g))
            elif "pos_embed" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=g) * (1.5 / fan_in ** 0.5))
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))


def image(rng, h, w):
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([np.sin(x / (2 + 3 * c) + y / (4 + c)) for c in range(3)], -1)
    return Image.fromarray(np.clip(127.5 + 100 * base + rng.normal(0, 20, (h, w, 3)), 0, 255).astype(np.uint8))


def greedy(model, processor, out, parts, steps):
    """The prompt's ids with each image expanded to its merged rows (and
    the matching mm_token_type_ids), then greedy decoding."""
    files = [p["image"] for p in parts if "image" in p]
    inputs = processor(images=[Image.open(out / f) for f in files], return_tensors="pt")
    merged = (inputs["image_grid_thw"].prod(-1) // 4).tolist()
    ids, types, counts = [], [], iter(merged)
    for p in parts:
        if "text" in p:
            ids += p["text"]
            types += [0] * len(p["text"])
        else:
            n = next(counts)
            ids += [CONFIG["image_token_id"]] * n
            types += [1] * n
    prompt = list(ids)
    with torch.no_grad():
        hidden = model(
            input_ids=torch.tensor([ids]), mm_token_type_ids=torch.tensor([types]),
            pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"], output_hidden_states=True,
        ).hidden_states
    # Each layer's output (entry i + 1; the last entry is after the final norm).
    layer_outputs = [h[0].float().tolist() for h in hidden[1:-1]]
    generated, rows = [], []
    with torch.no_grad():
        for _ in range(steps + 1):
            logits = model(
                input_ids=torch.tensor([ids]), mm_token_type_ids=torch.tensor([types]),
                pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
            ).logits[0, -1].float()
            rows.append(logits.tolist())
            nxt = int(torch.argmax(logits))
            top2 = torch.topk(logits, 2).values
            assert float(top2[0] - top2[1]) > 0.01, "a greedy choice too close to call"
            generated.append(nxt)
            ids.append(nxt)
            types.append(0)
    return dict(prompt_ids=prompt, generated_ids=generated, logits=rows, layer_outputs=layer_outputs)


def make(out, model_type, cls, cfg):
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    config = AutoConfig.for_model(model_type, **json.loads(json.dumps(cfg)))
    config.architectures = [cls.__name__]
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(config).to(torch.float32).eval()
    randomize(model, 0)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    if model_type == "qwen3_vl_moe":
        transpose_experts(out / "model.safetensors")
    model = cls.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    (out / "preprocessor_config.json").write_text(json.dumps(PROCESSOR, indent=1) + "\n")
    processor = Qwen2VLImageProcessorPil(**PROCESSOR)
    rng = np.random.default_rng(1)
    vision = dict(transformers_version=transformers.__version__, torch_version=torch.__version__, images={})
    for name, (h, w) in IMAGES.items():
        image(rng, h, w).save(out / name)
        inputs = processor(images=[Image.open(out / name)], return_tensors="pt")
        with torch.no_grad():
            result = model.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"])
        vision["images"][name] = dict(
            grid=inputs["image_grid_thw"][0].tolist(),
            merged=result.pooler_output.float().tolist(),
            deepstack=[d.float().tolist() for d in result.deepstack_features],
        )
        print(f"{out.name} {name}: grid {inputs['image_grid_thw'][0].tolist()}, {result.pooler_output.shape[0]} merged rows")
    (out / "vision.json").write_text(json.dumps(vision) + "\n")
    cases = []
    g = torch.Generator().manual_seed(3)
    text = lambda n: torch.randint(0, VOCAB - 4, (n,), generator=g).tolist()
    start, end = CONFIG["vision_start_token_id"], CONFIG["vision_end_token_id"]
    for name, images, steps in [("one_image", ["wide.png"], 8), ("two_images", ["tall.png", "wide.png"], 8)]:
        parts = [dict(text=text(5) + [start])]
        for i, file in enumerate(images):
            parts.append(dict(image=file))
            parts.append(dict(text=[end] + text(3 + 2 * i) + ([start] if i + 1 < len(images) else [])))
        cases.append(dict(name=name, parts=parts, **greedy(model, processor, out, parts, steps)))
        print(f"{out.name} {name}: {len(cases[-1]['prompt_ids'])} prompt ids, generated {cases[-1]['generated_ids']}")
    (out / "expected_images.json").write_text(json.dumps(dict(
        transformers_version=transformers.__version__, torch_version=torch.__version__, cases=cases)) + "\n")
    for extra in out.iterdir():
        if extra.name not in ("config.json", "model.safetensors", "preprocessor_config.json", "vision.json",
                              "expected_images.json", *IMAGES):
            extra.unlink()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/fixtures")
    root = Path(ap.parse_args().out)
    for name, (model_type, cls, cfg) in MODELS.items():
        make(root / name, model_type, cls, cfg)


if __name__ == "__main__":
    main()
