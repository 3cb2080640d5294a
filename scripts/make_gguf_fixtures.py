#!/usr/bin/env python3
"""Generates the GGUF conformance fixtures under tests/fixtures/gguf_*: tiny
random models of each GGUF architecture, written as llama.cpp's converter
writes them (f32, q/k rows of `llama` interleaved for its RoPE), quantized by
llama.cpp's `llama-quantize`, and the logits transformers computes in f32
from the quantized file's own dequantized weights (gguf's `dequantize`, q/k
rows put back).

Each case directory holds model.gguf (or a split set of them) and
expected.json (prompt_ids, generated_ids, logits), which
tests/conformance.rs checks like the other fixtures.

  python scripts/make_gguf_fixtures.py --quantize PATH/llama-quantize [CASE ...]

Needs torch, transformers, numpy and gguf. Widths are multiples of 256 so
that the k-quants apply; for each case the first seed whose greedy choices
all win by a clear margin (and take at least three different values) is
kept, so f32 rounding cannot flip an id.
"""
import argparse
import json
import math
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch
import gguf
from gguf.quants import dequantize
from transformers import AutoConfig, AutoModelForCausalLM

MIN_TOP2_GAP = 0.02
# Stands for the path of a random importance matrix in a case's options.
IMATRIX = "<imatrix>"
ROOT = Path(__file__).resolve().parent.parent


def base(model_type, **extra):
    cfg = dict(
        model_type=model_type, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=10000.0, vocab_size=256, max_position_embeddings=128, tie_word_embeddings=False,
    )
    cfg.update(extra)
    return cfg


# Qwen3's RoPE base and norm epsilon.
QWEN3_ROPE = dict(rope_theta=1000000.0, rms_norm_eps=1e-6)


def qwen3moe():
    """A Qwen3-MoE of 4 experts, 2 chosen, with normalised routing weights."""
    return base("qwen3_moe", moe_intermediate_size=256, num_experts=4, num_experts_per_tok=2,
                norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], **QWEN3_ROPE)


# name -> (gguf architecture, transformers config, llama-quantize type, or
# its options ending with the type)
CASES = {
    "gguf_llama_q4_k_m": ("llama", base("llama"), "Q4_K_M"),
    "gguf_llama_q8_0_tied": ("llama", base("llama", tie_word_embeddings=True), "Q8_0"),
    "gguf_llama_q2_k": ("llama", base("llama"), "Q2_K"),
    "gguf_qwen3_q5_k_m": ("qwen3", base("qwen3", **QWEN3_ROPE), "Q5_K_M"),
    "gguf_qwen3_q3_k_m": ("qwen3", base("qwen3", **QWEN3_ROPE), "Q3_K_M"),
    "gguf_qwen3_q4_0": ("qwen3", base("qwen3", tie_word_embeddings=True), "Q4_0"),
    "gguf_qwen3_q5_0": ("qwen3", base("qwen3", rope_theta=1000000.0), "Q5_0"),
    "gguf_qwen3moe_q4_k_m": ("qwen3moe", qwen3moe(), "Q4_K_M"),
    "gguf_mixtral_q5_1": ("llama", base(
        "mixtral", num_local_experts=4, num_experts_per_tok=2, sliding_window=None), "Q5_1"),
    "gguf_llama_q4_1": ("llama", base("llama"), "Q4_1"),
    # Llama 3.1's wavelength scaling, which llama.cpp's converter writes as
    # per-frequency divisors (rope_freqs.weight); an original context of 16
    # scales most frequencies at these positions.
    "gguf_llama3_rope_freqs_q4_k_m": ("llama", base("llama", max_position_embeddings=256, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16)), "Q4_K_M"),
    # Qwen3's YaRN for long contexts, with the keys llama.cpp's converter
    # writes (type, factor, original context); an original context of 32 puts
    # the ramp inside the 32 frequencies.
    "gguf_qwen3_yarn_q8_0": ("qwen3", base("qwen3", rope_theta=1000000.0, rms_norm_eps=1e-6, rope_scaling=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=32)), "Q8_0"),
    "gguf_minimax_m2_q4_k_m": ("minimax-m2", base(
        "minimax_m2", intermediate_size=256, num_local_experts=4, num_experts_per_tok=2, rotary_dim=32,
        scoring_func="sigmoid", use_routing_bias=True, rope_theta=5000000.0, rms_norm_eps=1e-6,
        bos_token_id=1, eos_token_id=2), "Q4_K_M"),
    # The non-linear 4-bit types (no importance matrix needed): IQ4_NL in
    # blocks of 32, IQ4_XS in super-blocks of 256 with 6-bit sub-block scales.
    "gguf_llama_iq4_nl": ("llama", base("llama"), "IQ4_NL"),
    "gguf_qwen3_iq4_xs": ("qwen3", base("qwen3", **QWEN3_ROPE), "IQ4_XS"),
    "gguf_qwen3moe_iq4_xs": ("qwen3moe", qwen3moe(), "IQ4_XS"),
    # An i-quant that llama-quantize writes without an importance matrix,
    # and MXFP4 as gpt-oss files use it (MXFP4_MOE: the experts in MXFP4,
    # the rest Q8_0).
    "gguf_llama_iq3_s": ("llama", base("llama"), "IQ3_S"),
    "gguf_qwen3moe_mxfp4": ("qwen3moe", qwen3moe(), "MXFP4_MOE"),
    # The types llama-quantize writes only with an importance matrix (IMATRIX:
    # a random one, written by write_imatrix), across the families.
    "gguf_llama_iq2_xxs": ("llama", base("llama"), ["--imatrix", IMATRIX, "IQ2_XXS"]),
    "gguf_qwen3_iq2_xs": ("qwen3", base("qwen3", **QWEN3_ROPE), ["--imatrix", IMATRIX, "IQ2_XS"]),
    "gguf_qwen3moe_iq2_m": ("qwen3moe", qwen3moe(), ["--imatrix", IMATRIX, "IQ2_M"]),
    "gguf_mixtral_iq3_xxs": ("llama", base(
        "mixtral", num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
        ["--imatrix", IMATRIX, "IQ3_XXS"]),
    "gguf_llama_iq1_s": ("llama", base("llama"), ["--imatrix", IMATRIX, "IQ1_S"]),
    "gguf_qwen3_iq1_m": ("qwen3", base("qwen3", **QWEN3_ROPE), ["--imatrix", IMATRIX, "IQ1_M"]),
    # A mix as the "dynamic" quants write them: Q4_K_M's own mix overridden
    # per tensor and per layer, so that one file holds nine types, the
    # experts in a different one per layer (a layer's gate and up share
    # theirs, as streaming them requires) and their down rows in another.
    "gguf_qwen3moe_mixed": ("qwen3moe", qwen3moe(), [
        "--tensor-type", "attn_q=iq4_xs", "--tensor-type", "attn_k=q8_0",
        r"--tensor-type", r"blk\.0\.ffn_(gate|up)_exps=iq4_nl",
        r"--tensor-type", r"blk\.1\.ffn_(gate|up)_exps=q5_0",
        "--tensor-type", "ffn_down_exps=q3_k", "--token-embedding-type", "q6_k",
        "--output-tensor-type", "q5_k", "Q4_K_M"]),
    # A dense layer's gate and up in types of their own (decoded to f32 on
    # load, where their rows are interleaved), its down in a third.
    "gguf_llama_gate_up_apart": ("llama", base("llama"), [
        "--tensor-type", "ffn_gate=q5_k", "--tensor-type", "ffn_up=iq4_nl",
        "--tensor-type", "ffn_down=q8_0", "Q4_K_M"]),
}


def permute(w, heads):
    """transformers' q/k rows to llama.cpp's interleaved order."""
    rows, cols = w.shape
    return w.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def unpermute(w, heads):
    rows, cols = w.shape
    return w.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def layout(arch, cfg):
    """(gguf name, transformers name or ("half", fused name, 0 gate / 1 up),
    heads whose rows llama.cpp interleaves or None), in file order."""
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    permuted = arch == "llama"
    out = [("token_embd.weight", "model.embed_tokens.weight", None)]
    for i in range(cfg["num_hidden_layers"]):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        out += [
            (b + "attn_norm.weight", p + "input_layernorm.weight", None),
            (b + "attn_q.weight", p + "self_attn.q_proj.weight", nh if permuted else None),
            (b + "attn_k.weight", p + "self_attn.k_proj.weight", nkv if permuted else None),
            (b + "attn_v.weight", p + "self_attn.v_proj.weight", None),
            (b + "attn_output.weight", p + "self_attn.o_proj.weight", None),
            (b + "ffn_norm.weight", p + "post_attention_layernorm.weight", None),
        ]
        if arch.startswith("qwen3") or arch == "minimax-m2":
            out += [(b + "attn_q_norm.weight", p + "self_attn.q_norm.weight", None),
                    (b + "attn_k_norm.weight", p + "self_attn.k_norm.weight", None)]
        if cfg["model_type"] in ("qwen3_moe", "mixtral", "minimax_m2"):
            # transformers 5 fuses each layer's experts: gate_up_proj [E, 2I, H]
            # (gate rows, then up rows), down_proj [E, H, I].
            fused = p + "mlp.experts."
            out += [(b + "ffn_gate_inp.weight", p + "mlp.gate.weight", None),
                    (b + "ffn_gate_exps.weight", ("half", fused + "gate_up_proj", 0), None),
                    (b + "ffn_up_exps.weight", ("half", fused + "gate_up_proj", 1), None),
                    (b + "ffn_down_exps.weight", fused + "down_proj", None)]
            if cfg.get("use_routing_bias"):
                out.append((b + "exp_probs_b.bias", p + "mlp.e_score_correction_bias", None))
        else:
            out += [(b + "ffn_gate.weight", p + "mlp.gate_proj.weight", None),
                    (b + "ffn_up.weight", p + "mlp.up_proj.weight", None),
                    (b + "ffn_down.weight", p + "mlp.down_proj.weight", None)]
    out.append(("output_norm.weight", "model.norm.weight", None))
    if not cfg["tie_word_embeddings"]:
        out.append(("output.weight", "lm_head.weight", None))
    return out


def take(sd, hf):
    if isinstance(hf, tuple):
        _, name, half = hf
        rows = sd[name].shape[1] // 2
        return sd[name][:, half * rows:(half + 1) * rows, :]
    return sd[hf]


def rope_freqs(cfg):
    """Llama 3's scaling as llama.cpp's converter writes it: the divisor of
    each rotary frequency (1 for short wavelengths, `factor` for long ones,
    smoothed between)."""
    scaling = cfg["rope_scaling"]
    dim = cfg["head_dim"]
    freqs = 1.0 / (cfg["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    old_context = scaling["original_max_position_embeddings"]
    low_wavelen = old_context / scaling["low_freq_factor"]
    high_wavelen = old_context / scaling["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(scaling["factor"])
        else:
            smooth = (old_context / wavelen - scaling["low_freq_factor"]) / (
                scaling["high_freq_factor"] - scaling["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / scaling["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def write_f32_gguf(path, arch, cfg, sd):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_dimension_count(cfg.get("rotary_dim", cfg["head_dim"]))
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg["model_type"] == "qwen3_moe":
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg["model_type"] == "minimax_m2":
        w.add_expert_feed_forward_length(cfg["intermediate_size"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("none")
    scaling = cfg.get("rope_scaling") or {}
    if scaling.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", rope_freqs(cfg))
    if scaling.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(scaling["factor"])
        w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
    for name, hf, heads in layout(arch, cfg):
        t = take(sd, hf)
        if heads:
            t = permute(t, heads)
        w.add_tensor(name, np.ascontiguousarray(t, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_imatrix(path, f32_path, seed):
    """A random importance matrix for every matrix of the f32 file, in
    llama.cpp's legacy imatrix layout: the entry count, then per tensor its
    name, the number of calls (1) and one positive value per input column
    (per expert and column for stacked experts), all little-endian."""
    rng = np.random.default_rng(seed)
    entries = [t for t in gguf.GGUFReader(str(f32_path)).tensors if len(t.shape) >= 2]
    with open(path, "wb") as f:
        f.write(np.int32(len(entries)).tobytes())
        for t in entries:
            name = t.name.encode()
            shape = [int(d) for d in t.shape]  # ggml order: columns first
            columns = shape[0] * int(np.prod(shape[2:]))
            f.write(np.int32(len(name)).tobytes() + name)
            f.write(np.int32(1).tobytes() + np.int32(columns).tobytes())
            f.write(rng.uniform(0.05, 2.0, columns).astype("<f4").tobytes())


def case(name, quantize):
    arch, cfg_dict, qtype = CASES[name]
    cfg = AutoConfig.for_model(**cfg_dict)
    cfg_dict = dict(cfg_dict)
    for seed in range(50):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, 1.5 / p.shape[-1] ** 0.5)
                else:
                    p.uniform_(0.8, 1.2)
            for pname, p in [*model.named_parameters(), *model.named_buffers()]:
                if pname.endswith("e_score_correction_bias"):
                    # Large enough to change which experts are chosen.
                    p.normal_(0.0, 0.5)
        sd = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
        with tempfile.TemporaryDirectory() as tmp:
            f32_path, q_path = Path(tmp) / "f32.gguf", Path(tmp) / "q.gguf"
            write_f32_gguf(f32_path, arch, cfg_dict, sd)
            options = qtype if isinstance(qtype, list) else [qtype]
            shown = " ".join(options)
            if IMATRIX in options:
                imatrix = Path(tmp) / "imatrix.dat"
                write_imatrix(imatrix, f32_path, seed)
                options = [str(imatrix) if o == IMATRIX else o for o in options]
            subprocess.run([quantize, *options[:-1], str(f32_path), str(q_path), options[-1]],
                           check=True, capture_output=True)
            r = gguf.GGUFReader(str(q_path))
            values = {t.name: dequantize(t.data, t.tensor_type).astype(np.float32)
                      .reshape([int(d) for d in reversed(t.shape)]) for t in r.tensors}
            types = sorted({t.tensor_type.name for t in r.tensors})
            new_sd, halves = {}, {}
            for g_name, hf, heads in layout(arch, cfg_dict):
                v = values[g_name]
                if heads:
                    v = unpermute(v, heads)
                if isinstance(hf, tuple):
                    halves.setdefault(hf[1], {})[hf[2]] = v
                else:
                    new_sd[hf] = torch.from_numpy(v.copy())
            for fused, parts in halves.items():
                new_sd[fused] = torch.from_numpy(np.concatenate([parts[0], parts[1]], axis=1))
            if cfg_dict["tie_word_embeddings"]:
                new_sd["lm_head.weight"] = new_sd["model.embed_tokens.weight"]
            model.load_state_dict(new_sd, strict=True)
            data = (Path(q_path).read_bytes(), types)
        ok, expected = run(model, cfg_dict, seed)
        if ok and cfg_dict.get("rope_scaling"):
            effect = scaling_effect(model, cfg_dict, expected["prompt_ids"] + expected["generated_ids"])
            assert effect > 1e-2, f"{name}: rope scaling moves the logits by only {effect}"
            print(f"{name}: rope scaling moves the logits by {effect:.3f}")
        if ok:
            out = ROOT / "tests/fixtures" / name
            out.mkdir(parents=True, exist_ok=True)
            (out / "model.gguf").write_bytes(data[0])
            expected.update(types=data[1], seed=seed, quantization=shown)
            (out / "expected.json").write_text(json.dumps(expected))
            print(f"{name}: seed {seed}, types {data[1]}, ids {expected['generated_ids']}")
            return
    raise SystemExit(f"{name}: no seed gives clear greedy choices")


def scaling_effect(model, cfg, ids):
    """How far the logits of `ids` move when the same weights run without
    the config's rope scaling: proof that the fixture exercises it."""
    plain_cfg = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "rope_scaling"})
    plain = AutoModelForCausalLM.from_config(plain_cfg, attn_implementation="eager").float().eval()
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        scaled = model(torch.tensor([ids])).logits
        unscaled = plain(torch.tensor([ids])).logits
    return (scaled - unscaled).abs().max().item()


def run(model, cfg, seed, prompt_len=12, steps=8):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, cfg["vocab_size"], (prompt_len,), generator=g).tolist()
    ids, rows = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            top = torch.topk(logits, 2).values
            if (top[0] - top[1]).item() < MIN_TOP2_GAP:
                return False, None
            rows.append(logits.tolist())
            ids.append(int(torch.argmax(logits)))
    # A continuation that varies, so positions and the cache matter.
    if len(set(ids[prompt_len:])) < 3:
        return False, None
    return True, dict(prompt_ids=prompt, generated_ids=ids[prompt_len:], logits=rows)


# name -> (the case it splits, tensors per file): the case's model as a
# split set (`model-00001-of-0000N.gguf` ...) written by gguf-py's writer as
# llama.cpp's converter splits with --split-max-tensors, its first file
# metadata only (as --no-tensor-first-split leaves it); same expected.json.
SPLITS = {
    "gguf_llama_q2_k_split": ("gguf_llama_q2_k", 8),
}


def split_case(name):
    source, max_tensors = SPLITS[name]
    src, out = ROOT / "tests/fixtures" / source, ROOT / "tests/fixtures" / name
    r = gguf.GGUFReader(str(src / "model.gguf"))
    arch = r.fields["general.architecture"].contents()
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.gguf"):
        old.unlink()
    w = gguf.GGUFWriter(str(out / "model.gguf"), arch, split_max_tensors=max_tensors, small_first_shard=True)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), field.types[0], sub_type)
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    expected = json.loads((src / "expected.json").read_text())
    expected.update(split_from=source, split_max_tensors=max_tensors)
    (out / "expected.json").write_text(json.dumps(expected))
    print(f"{name}: {source} in {len(list(out.glob('*.gguf')))} files")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quantize", required=True, help="llama.cpp's llama-quantize")
    ap.add_argument("cases", nargs="*")
    args = ap.parse_args()
    for name in args.cases or [*CASES, *SPLITS]:
        if name in SPLITS:
            split_case(name)
        else:
            case(name, args.quantize)


if __name__ == "__main__":
    main()
