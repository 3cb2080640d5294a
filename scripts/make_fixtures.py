#!/usr/bin/env python3
"""Generates the conformance fixtures under tests/fixtures/ with transformers.

Each case is a tiny random model: config.json, model.safetensors (bf16) and
expected.json (prompt_ids, generated_ids, logits). Logits are computed on the
CPU in float32 over the bf16-rounded weights, with eager attention, by a model
reloaded from the written folder, so the config as written (either layout) is
what transformers interpreted.

  python scripts/make_fixtures.py [--out tests/fixtures] [CASE ...]

Needs torch and transformers (CPU is enough). Seeds are fixed; for each case
the first seed whose greedy choices all win by a clear margin is kept, so f32
rounding cannot flip an id.
"""
import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

MIN_TOP2_GAP = 0.02  # logits; the conformance tolerance is 1e-3


def llama_untied():
    return "hub", dict(
        architectures=["LlamaForCausalLM"], model_type="llama",
        hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
        rms_norm_eps=1e-5, rope_theta=50000.0, rope_scaling=None,
        vocab_size=250, max_position_embeddings=128,
        tie_word_embeddings=False,
    )


def llama3_tied():
    # head_dim 24 != 64 / 4, and llama3 scaling whose original context (16)
    # puts most wavelengths in the scaled and smoothed bands at these positions.
    return "v5", dict(
        architectures=["LlamaForCausalLM"], model_type="llama",
        hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=24,
        rms_norm_eps=1e-6, vocab_size=301, max_position_embeddings=256,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                             low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=16),
        tie_word_embeddings=True,
    )


def mistral_window():
    # A sliding window shorter than prompt + generation, so it matters.
    return "hub", dict(
        architectures=["MistralForCausalLM"], model_type="mistral",
        hidden_size=96, intermediate_size=160, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=2,
        rms_norm_eps=1e-5, rope_theta=1000000.0, sliding_window=7,
        vocab_size=200, max_position_embeddings=128, tie_word_embeddings=False,
    )


# name -> (config builder, options). `must_matter` lists config changes that
# must change the logits: proof that the feature under test is exercised and
# that transformers read the field from the layout as written.
CASES = {
    "llama_untied": (llama_untied, dict(prompt_len=12, steps=8, must_matter=[
        dict(rope_theta=10000.0),
    ])),
    "llama3_tied": (llama3_tied, dict(prompt_len=12, steps=8, must_matter=[
        dict(rope_parameters=dict(rope_type="default", rope_theta=500000.0)),
    ])),
    "mistral_window": (mistral_window, dict(prompt_len=12, steps=8, must_matter=[
        dict(sliding_window=None),
        dict(rope_theta=10000.0),
    ])),
}


def randomize(model, seed):
    """Weights wide enough that logits are well separated; norm weights away from 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # RMSNorm weights
                p.copy_(torch.empty(p.shape).uniform_(0.5, 1.5, generator=g))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=g) * (1.5 / fan_in ** 0.5))
        # bf16-round everything: the GPU sees bf16 weights.
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))


def greedy_rows(model, prompt, steps):
    """Row 0: logits at the last prompt position; row i: after feeding generated[i-1]."""
    ids = list(prompt)
    rows, generated = [], []
    with torch.no_grad():
        for _ in range(steps + 1):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            rows.append(logits)
            nxt = int(torch.argmax(logits))
            generated.append(nxt)
            ids.append(nxt)
    return generated, rows


def build(cfg_dict):
    cfg_kwargs = {k: v for k, v in cfg_dict.items() if k not in ("architectures", "model_type")}
    config = AutoConfig.for_model(cfg_dict["model_type"], **cfg_kwargs)
    config.architectures = cfg_dict["architectures"]
    config._attn_implementation = "eager"
    return config


def teacher_forced(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def check_features_matter(name, cfg_dict, changes, weights, ids):
    base = build(cfg_dict)
    ref = AutoModelForCausalLM.from_config(base, dtype=torch.float32)
    ref.load_state_dict(weights)
    want = teacher_forced(ref, ids)
    for change in changes:
        model = AutoModelForCausalLM.from_config(build({**cfg_dict, **change}), dtype=torch.float32)
        model.load_state_dict(weights)
        diff = float((teacher_forced(model, ids) - want).abs().max())
        if diff < 1e-2:
            sys.exit(f"{name}: changing {change} moves logits by only {diff}: the case does not test it")


def top2_gap(rows):
    return min(float(torch.topk(r, 2).values[0] - torch.topk(r, 2).values[1]) for r in rows)


def write_config(path, layout, cfg_dict, saved_config):
    if layout == "v5":
        # Keep transformers' own serialisation (rope_parameters, dtype).
        return
    hub = dict(cfg_dict)
    hub["torch_dtype"] = "bfloat16"
    hub["transformers_version"] = "4.46.0"
    path.write_text(json.dumps(hub, indent=2) + "\n")


def make_case(name, out_root):
    make_config, opts = CASES[name]
    layout, cfg_dict = make_config()
    out = out_root / name
    for seed in range(1000):
        config = build(cfg_dict)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        randomize(model, seed)

        g = torch.Generator().manual_seed(10_000 + seed)
        prompt = torch.randint(0, config.vocab_size, (opts["prompt_len"],), generator=g).tolist()

        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
        write_config(out / "config.json", layout, cfg_dict, model.config)

        reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
        reloaded.eval()
        generated, rows = greedy_rows(reloaded, prompt, opts["steps"])
        gap = top2_gap(rows)
        if gap < MIN_TOP2_GAP:
            continue
        check_features_matter(name, cfg_dict, opts["must_matter"], reloaded.state_dict(),
                              prompt + generated[:-1])
        for extra in out.iterdir():
            if extra.name not in ("config.json", "model.safetensors"):
                extra.unlink()
        expected = dict(
            prompt_ids=prompt,
            generated_ids=generated,
            logits=[r.tolist() for r in rows],
            seed=seed,
            min_top2_gap=gap,
            config_layout=layout,
            transformers_version=transformers.__version__,
            torch_version=torch.__version__,
        )
        (out / "expected.json").write_text(json.dumps(expected) + "\n")
        print(f"{name}: seed {seed}, {len(rows)} rows, min top-2 gap {gap:.4f}, layout {layout}")
        return
    sys.exit(f"{name}: no seed gave a top-2 gap of {MIN_TOP2_GAP}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "tests" / "fixtures"))
    ap.add_argument("cases", nargs="*", default=list(CASES))
    args = ap.parse_args()
    torch.set_num_threads(2)
    for name in args.cases:
        make_case(name, Path(args.out))


if __name__ == "__main__":
    main()
