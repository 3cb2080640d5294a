#!/usr/bin/env python3
"""Generates the block-FP8 conformance fixtures under tests/fixtures/fp8_*:
tiny random models written as Hugging Face's block-FP8 releases ship them
(Qwen3-*-FP8, MiniMax-M2, DeepSeek-V3).

Every attention projection (q/k/v/o_proj) and every MLP or expert projection
(gate/up/down_proj; w1/w2/w3 of MiniMax-M2's experts) is stored as F8_E4M3
with a companion `<prefix>.weight_scale_inv` of shape
[ceil(out / 128), ceil(in / 128)]:

    W[i, j] = float(fp8[i, j]) * weight_scale_inv[i // 128, j // 128]

quantized block by block (scale = max |W| over the block / 448). Embeddings,
lm_head, every norm (q_norm / k_norm included), the MoE router and its
e_score_correction_bias stay bf16, but for the tensors a case keeps in F32
(MiniMax-M2's router, as its release stores it). config.json carries the
release's `quantization_config`.

Each case directory holds config.json, model.safetensors and expected.json
(prompt_ids, generated_ids, logits), checked by tests/conformance.rs like the
other fixtures. Logits are transformers' on the CPU in float32 with eager
attention, by a model loaded from a float32 copy of the checkpoint with the
dequantized weights (fp8 value times its block's scale, in f32) and the other
tensors at their bf16 values. transformers' own FP8 integration is not the
reference (its kernels need a GPU); where it loads on the CPU (dequantizing,
with accelerate installed), its logits are compared with the reference's and
the difference printed, for information only.

  python scripts/make_fp8_fixtures.py [--out tests/fixtures] [CASE ...]

Needs torch, transformers and safetensors (CPU is enough); reuses
make_fixtures.py's config builder, randomization, greedy rows and margin
checks. Projection magnitudes vary by channel and by 128-wide channel group,
so block scales differ from block to block, and the script checks that
misreading the scale grid (one scale for the whole tensor, the first row or
column of blocks for all, a partial edge block taking its neighbour's scale,
every expert taking expert 0's scales) moves the logits well past the conformance tolerance. Seeds are fixed; for
each case the first seed whose greedy choices and router selections all win
by a clear margin, and whose continuation takes at least five different
ids, is kept.
"""
import argparse
import contextlib
import io
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_fixtures as mf  # noqa: E402

BLOCK = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# Logits must move by at least this much when the scale grid is misread.
MIN_SCALE_EFFECT = 1e-2
# ... and when a tensor kept in F32 is rounded to bf16 (five times the
# tolerance, F32_TOLERANCE, that such a case asks of the exact
# configuration in tests/conformance.rs).
F32_TOLERANCE = 1e-4
MIN_F32_EFFECT = 5e-4
# A continuation that varies, so positions and the KV cache matter.
MIN_DISTINCT_IDS = 5

# As in Qwen3-*-FP8's config.json.
QWEN3_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
             "weight_block_size": [BLOCK, BLOCK]}
# As in MiniMax-M2's config.json.
MINIMAX_M2_FP8 = {"activation_scheme": "dynamic", "fmt": "float8_e4m3fn", "quant_method": "fp8",
                  "weight_block_size": [BLOCK, BLOCK],
                  "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]}

# Checkpoint names (hub layout) of the projections stored as FP8.
FP8_NAME = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
# The same projections as transformers holds them in memory (experts fused).
FP8_PARAM = re.compile(r"(\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight"
                       r"|\.experts\.(gate_up_proj|down_proj))$")


def fp8_qwen3_dense():
    # Every projection a whole number of 128 x 128 blocks: q 256 x 256,
    # k/v 128 x 256, o 256 x 256, gate/up 384 x 256, down 256 x 384.
    return "v5", dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3",
        hidden_size=256, intermediate_size=384, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        rms_norm_eps=1e-6, vocab_size=240, max_position_embeddings=128,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        tie_word_embeddings=False, use_sliding_window=False,
    )


def fp8_minimax_m2():
    # Whole-projection q/k norm, partial rotary (32 of 64 dims), sigmoid
    # routing with a correction bias; q 256 x 128, k/v 128 x 128,
    # o 128 x 256; each expert's w1/w3 192 x 128 and w2 128 x 192, so the
    # expert grids have two blocks, the second partial. bf16 scales.
    return "hub", dict(
        architectures=["MiniMaxM2ForCausalLM"], model_type="minimax_m2",
        hidden_size=128, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, rotary_dim=32,
        num_local_experts=6, num_experts_per_tok=2, scoring_func="sigmoid", use_routing_bias=True,
        rms_norm_eps=1e-6, rope_theta=5000000.0, vocab_size=180, bos_token_id=1, eos_token_id=2,
        max_position_embeddings=128, tie_word_embeddings=False,
    )


def fp8_partial_blocks():
    # No width a multiple of 128: hidden 192 (blocks of 128 + 64), q 240
    # (128 + 112), k/v 80 (one partial block), intermediate 320
    # (128 + 128 + 64). Tied embeddings.
    return "v5", dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3",
        hidden_size=192, intermediate_size=320, num_hidden_layers=2,
        num_attention_heads=3, num_key_value_heads=1, head_dim=80,
        rms_norm_eps=1e-6, vocab_size=200, max_position_embeddings=128,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        tie_word_embeddings=True, use_sliding_window=False,
    )


def fp8_qwen3_moe():
    # As Qwen3-30B-A3B-FP8 ships: one FP8 gate/up/down per expert, the
    # router bf16; f16 scales; each expert 160 wide (blocks of 128 + 32).
    return "hub", dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
        hidden_size=128, intermediate_size=256, moe_intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[],
        rms_norm_eps=1e-6, rope_theta=1000000.0, vocab_size=150,
        max_position_embeddings=128, tie_word_embeddings=False, use_sliding_window=False,
    )


# name -> (config builder, options). `scale_dtype` is the dtype of every
# weight_scale_inv; `must_matter` as in make_fixtures.py.
CASES = {
    "fp8_qwen3_dense": (fp8_qwen3_dense, dict(
        prompt_len=12, steps=8, quantization_config=QWEN3_FP8, scale_dtype=torch.float32,
        must_matter=[dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0))])),
    "fp8_minimax_m2": (fp8_minimax_m2, dict(
        prompt_len=12, steps=8, quantization_config=MINIMAX_M2_FP8, scale_dtype=torch.bfloat16,
        must_matter=[dict(rotary_dim=64)], bias_scale=0.15)),
    "fp8_qwen3_moe": (fp8_qwen3_moe, dict(
        prompt_len=12, steps=8, quantization_config=QWEN3_FP8, scale_dtype=torch.float16,
        must_matter=[dict(num_experts_per_tok=1)])),
    # The router's gate.weight in F32 with values bf16 cannot hold: an
    # engine that rounds it to bf16 moves the logits (by
    # logit_move_when_f32_rounded_to_bf16 in expected.json).
    "fp8_minimax_m2_f32_router": (fp8_minimax_m2, dict(
        prompt_len=12, steps=8, quantization_config=MINIMAX_M2_FP8, scale_dtype=torch.bfloat16,
        must_matter=[dict(rotary_dim=64)], bias_scale=0.15, keep_f32=r"\.block_sparse_moe\.gate\.weight$")),
    "fp8_partial_blocks": (fp8_partial_blocks, dict(
        prompt_len=12, steps=8, quantization_config=QWEN3_FP8, scale_dtype=torch.float32,
        must_matter=[dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0))])),
}

SAFETENSORS_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def vary_magnitudes(model, seed, sigma=0.5):
    """Scales each FP8-bound projection by log-normal factors per output and
    input channel and per 128-wide group of them (unit mean square), so that
    blocks have different largest values and thus different scales."""
    g = torch.Generator().manual_seed(30_000 + seed)

    def factors(shape, n):
        per_channel = torch.randn(shape + (n,), generator=g) * sigma
        groups = -(-n // BLOCK)
        per_group = (torch.randn(shape + (groups,), generator=g) * sigma).repeat_interleave(BLOCK, -1)[..., :n]
        return torch.exp(per_channel + per_group - sigma ** 2)

    with torch.no_grad():
        for name, p in model.named_parameters():
            if FP8_PARAM.search(name):
                lead = tuple(p.shape[:-2])
                rows = factors(lead, p.shape[-2])
                cols = factors(lead, p.shape[-1])
                p.mul_(rows.unsqueeze(-1) * cols.unsqueeze(-2))
                p.copy_(p.to(torch.bfloat16).to(torch.float32))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(b.to(torch.bfloat16).to(torch.float32))


def keep_full_precision(model, seed, keep_f32):
    """Jitters the tensors a case keeps in F32 (randomize leaves every
    value on the bf16 grid), so that bf16 cannot hold them."""
    g = torch.Generator().manual_seed(40_000 + seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if re.search(keep_f32, name.replace(".mlp.", ".block_sparse_moe.")):
                p.add_(torch.randn(p.shape, generator=g) * float(p.std()) * 0.01)


def expand(scale, rows, cols):
    """One scale per element of a [rows, cols] weight."""
    return scale.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]


def quantize(w, scale_dtype):
    """Block FP8 of a 2-D weight: (fp8 [out, in], weight_scale_inv
    [ceil(out / 128), ceil(in / 128)] in scale_dtype)."""
    w = w.float()
    rows, cols = w.shape
    br, bc = -(-rows // BLOCK), -(-cols // BLOCK)
    padded = torch.zeros(br * BLOCK, bc * BLOCK)
    padded[:rows, :cols] = w.abs()
    amax = padded.reshape(br, BLOCK, bc, BLOCK).amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).to(scale_dtype)
    # Divide by the scale as stored, so that the file's scale is the one used.
    q = (w / expand(scale.float(), rows, cols)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize(q, scale):
    rows, cols = q.shape
    return q.float() * expand(scale.float(), rows, cols)


def fp8_checkpoint(hub, scale_dtype, f32=None):
    """The checkpoint as shipped: FP8 projections with their scales, the
    tensors of `f32` (hub name -> f32 values) in F32, the rest bf16."""
    out = {}
    for name, t in hub.items():
        if f32 and name in f32:
            out[name] = f32[name].contiguous()
        elif FP8_NAME.search(name):
            q, scale = quantize(t, scale_dtype)
            out[name] = q.contiguous()
            out[name + "_scale_inv"] = scale.contiguous()
        else:
            out[name] = t.to(torch.bfloat16).contiguous()
    return out


def dequantized_state(tensors, remap=None):
    """f32 hub-layout state of a checkpoint: each FP8 weight times its block
    scales (or `remap(name, scale, rows, cols)` of them), the rest as stored."""
    out = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        if t.dtype == FP8:
            scale = tensors[name + "_scale_inv"].float()
            if remap is not None:
                scale = remap(name, scale, *t.shape)
            out[name] = dequantize(t, scale)
        else:
            out[name] = t.float()
    return out


def in_memory(hub, model):
    """Hub-layout tensors under the names and shapes of model.state_dict():
    per-expert projections fused as transformers holds them
    (experts.gate_up_proj [E, 2I, H] gate rows then up rows; experts.down_proj [E, H, I]),
    MiniMax-M2's block_sparse_moe renamed mlp."""
    hub = {k.replace(".block_sparse_moe.", ".mlp."): v for k, v in hub.items()}
    out = {}
    n_experts = getattr(model.config, "num_local_experts", None) or getattr(model.config, "num_experts", 0)
    for name, ref in model.state_dict().items():
        if name in hub:
            out[name] = hub[name]
        elif name.endswith(".experts.gate_up_proj"):
            p = name[: -len("gate_up_proj")]
            gate, up = ("w1", "w3") if p + "0.w1.weight" in hub else ("gate_proj", "up_proj")
            out[name] = torch.stack([torch.cat([hub[f"{p}{e}.{gate}.weight"], hub[f"{p}{e}.{up}.weight"]])
                                     for e in range(n_experts)])
        elif name.endswith(".experts.down_proj"):
            p = name[: -len("down_proj")]
            down = "w2" if p + "0.w2.weight" in hub else "down_proj"
            out[name] = torch.stack([hub[f"{p}{e}.{down}.weight"] for e in range(n_experts)])
        elif name == "lm_head.weight" and model.config.tie_word_embeddings:
            out[name] = hub["model.embed_tokens.weight"]
        else:
            raise KeyError(f"{name} has no counterpart in the checkpoint")
        assert out[name].shape == ref.shape, f"{name}: {tuple(out[name].shape)} vs {tuple(ref.shape)}"
    return out


def write_config(path, layout, cfg_dict, quantization_config):
    """config.json as make_fixtures.py writes it for `layout`, with the
    release's quantization_config when one is given."""
    if layout.startswith("v5"):
        doc = json.loads(path.read_text())  # transformers' own serialisation
        doc.pop("quantization_config", None)
        if quantization_config is not None:
            doc["quantization_config"] = quantization_config
        path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        return
    mf.write_config(path, layout, cfg_dict, None)
    if quantization_config is not None:
        doc = json.loads(path.read_text())
        doc["quantization_config"] = quantization_config
        path.write_text(json.dumps(doc, indent=2) + "\n")


def load_f32(folder):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


# Misreadings of the scale grid that a conformance run must catch:
# (weight name, its scale grid, rows, cols, every tensor) -> a grid of the
# same shape, or None where the misreading changes nothing for this tensor.
def one_scale(name, scale, rows, cols, tensors):
    return torch.full_like(scale, float(scale.mean())) if scale.numel() > 1 else None


def first_block_row(name, scale, rows, cols, tensors):
    return scale[:1].expand_as(scale).clone() if scale.shape[0] > 1 else None


def first_block_column(name, scale, rows, cols, tensors):
    return scale[:, :1].expand_as(scale).clone() if scale.shape[1] > 1 else None


def first_expert_scales(name, scale, rows, cols, tensors):
    """Every expert read with expert 0's scales."""
    m = re.search(r"\.experts\.(\d+)\.", name)
    if m is None or m.group(1) == "0":
        return None
    return tensors[name[: m.start()] + ".experts.0." + name[m.end():] + "_scale_inv"].float()


def edge_takes_neighbour(name, scale, rows, cols, tensors):
    """A partial last block (rows or columns) read with the previous block's scale."""
    out = scale.clone()
    changed = False
    if rows % BLOCK and scale.shape[0] > 1:
        out[-1] = scale[-2]
        changed = True
    if cols % BLOCK and scale.shape[1] > 1:
        out[:, -1] = scale[:, -2]
        changed = True
    return out if changed else None


MISREADINGS = {
    "one_scale_per_tensor": one_scale,
    "first_block_row_for_all": first_block_row,
    "first_block_column_for_all": first_block_column,
    "partial_edge_takes_neighbour": edge_takes_neighbour,
    "experts_share_expert_0_scales": first_expert_scales,
}


def scale_effects(tensors, model, ids):
    """Max |logit change| over the teacher-forced ids for each misreading that
    changes at least one tensor (None for the others)."""
    want = mf.teacher_forced(model, ids)
    alt = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
    effects = {}
    for name, misread in MISREADINGS.items():
        touched = [False]

        def remap(weight, scale, rows, cols):
            new = misread(weight, scale, rows, cols, tensors)
            if new is None:
                return scale
            touched[0] = True
            return new

        state = in_memory(dequantized_state(tensors, remap), model)
        if not touched[0]:
            effects[name] = None
            continue
        alt.load_state_dict(state)
        effects[name] = float((mf.teacher_forced(alt, ids) - want).abs().max())
    return effects


def f32_effect(tensors, model, ids, keep_f32):
    """Max |logit change| over the teacher-forced ids when the tensors kept
    in F32 are rounded to bf16."""
    if not keep_f32:
        return None
    rounded = {k: (v.to(torch.bfloat16).float() if re.search(keep_f32, k) else v) for k, v in tensors.items()}
    alt = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
    alt.load_state_dict(in_memory(dequantized_state(rounded), model))
    return float((mf.teacher_forced(alt, ids) - mf.teacher_forced(model, ids)).abs().max())


def check_fixture(out, model, keep_f32=None):
    """Reopens the written checkpoint: dtypes, shapes, names; its dequantized
    weights must equal the reference model's exactly. Returns a summary."""
    scale_dtypes, fp8_count, codes = set(), 0, set()
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = sorted(f.keys())
        tensors = {k: f.get_tensor(k) for k in names}
        dtypes = {k: f.get_slice(k).get_dtype() for k in names}
    for name in names:
        t = tensors[name]
        if name.endswith(".weight_scale_inv"):
            weight = tensors[name[: -len("_scale_inv")]]
            want = [-(-d // BLOCK) for d in weight.shape]
            assert list(t.shape) == want, f"{name}: shape {list(t.shape)}, want {want}"
            scale_dtypes.add(dtypes[name])
        elif FP8_NAME.search(name):
            assert dtypes[name] == "F8_E4M3", f"{name}: {dtypes[name]}"
            assert name + "_scale_inv" in tensors, f"{name}: no weight_scale_inv"
            fp8_count += 1
            codes.update(t.view(torch.uint8).unique().tolist())
        elif keep_f32 and re.search(keep_f32, name):
            assert dtypes[name] == "F32", f"{name}: {dtypes[name]} should stay F32"
        else:
            assert dtypes[name] == "BF16", f"{name}: {dtypes[name]} should stay bf16"
    state = in_memory(dequantized_state(tensors), model)
    ref = model.state_dict()
    for name, t in state.items():
        assert torch.equal(t, ref[name]), f"{name}: dequantized file differs from the reference by " \
                                          f"{float((t - ref[name]).abs().max())}"
    return dict(names=names, dtypes=dtypes, tensors=tensors, fp8_count=fp8_count,
                scale_dtypes=sorted(scale_dtypes), codes=len(codes))


def transformers_fp8_cpu(out, prompt, steps, rows):
    """transformers' own FP8 loading on the CPU (it dequantizes): max |logit
    difference| from the reference rows, or why it could not run."""
    verbosity = transformers.logging.get_verbosity()
    try:
        transformers.logging.set_verbosity(transformers.logging.CRITICAL)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            model = load_f32(out)
        _, got = mf.greedy_rows(model, prompt, steps)
        return "max |logit diff| from the reference %.3e" % max(
            float((a - b).abs().max()) for a, b in zip(got, rows))
    except Exception as e:  # informational only
        return f"does not load: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    finally:
        transformers.logging.set_verbosity(verbosity)


def make_case(name, out_root):
    make_config, opts = CASES[name]
    layout, cfg_dict = make_config()
    out = out_root / name
    for seed in range(1000):
        config = mf.build(cfg_dict)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        mf.randomize(model, seed, opts.get("bias_scale", 0.0))
        vary_magnitudes(model, seed)
        if opts.get("keep_f32"):
            keep_full_precision(model, seed, opts["keep_f32"])
        full = {k.replace(".mlp.", ".block_sparse_moe."): v.detach().clone() for k, v in model.state_dict().items()}

        g = torch.Generator().manual_seed(10_000 + seed)
        prompt = torch.randint(0, config.vocab_size, (opts["prompt_len"],), generator=g).tolist()

        with tempfile.TemporaryDirectory() as tmp:
            bf16_dir, fp8_dir, ref_dir = (Path(tmp) / d for d in ("bf16", "fp8", "ref"))
            # The bf16 checkpoint in the hub layout, as transformers writes it.
            model.to(torch.bfloat16).save_pretrained(bf16_dir, safe_serialization=True)
            write_config(bf16_dir / "config.json", layout, cfg_dict, None)
            hub = load_file(str(bf16_dir / "model.safetensors"))
            keep_f32 = opts.get("keep_f32")
            f32 = {k: full[k] for k in hub if keep_f32 and re.search(keep_f32, k)}
            assert not keep_f32 or f32, f"{name}: nothing matches {keep_f32}"
            fp8_dir.mkdir()
            save_file(fp8_checkpoint(hub, opts["scale_dtype"], f32), str(fp8_dir / "model.safetensors"),
                      metadata={"format": "pt"})
            shutil.copy(bf16_dir / "config.json", fp8_dir / "config.json")
            write_config(fp8_dir / "config.json", layout, cfg_dict, opts["quantization_config"])
            # The reference: a float32 checkpoint of the file's dequantized values.
            ref_dir.mkdir()
            shutil.copy(bf16_dir / "config.json", ref_dir / "config.json")
            tensors = load_file(str(fp8_dir / "model.safetensors"))
            save_file({k: v.contiguous() for k, v in dequantized_state(tensors).items()},
                      str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
            reference = load_f32(ref_dir)

            generated, rows = mf.greedy_rows(reference, prompt, opts["steps"])
            gap = mf.top2_gap(rows)
            if gap < mf.MIN_TOP2_GAP or len(set(generated)) < MIN_DISTINCT_IDS:
                continue
            ids = prompt + generated[:-1]
            router_gap = bias_share = None
            if "num_experts_per_tok" in cfg_dict:
                probe = mf.RouterProbe(reference, cfg_dict)
                mf.teacher_forced(reference, ids)
                probe.remove()
                router_gap = probe.min_gap()
                if router_gap < mf.MIN_ROUTER_GAP:
                    continue
                if cfg_dict.get("scoring_func") == "sigmoid":
                    bias_share = probe.bias_changed_share()
                    if not 0.3 <= bias_share <= 0.8:
                        continue
            mf.check_features_matter(name, cfg_dict, opts["must_matter"], reference.state_dict(), ids)
            effects = scale_effects(tensors, reference, ids)
            weak = {k: v for k, v in effects.items() if v is not None and v < MIN_SCALE_EFFECT}
            if weak:
                sys.exit(f"{name}: misreading the scale grid moves logits by only {weak}")
            rounding = f32_effect(tensors, reference, ids, keep_f32)
            if rounding is not None and rounding < MIN_F32_EFFECT:
                print(f"{name}: seed {seed}: rounding the F32 tensors moves logits by only {rounding:.2e}")
                continue
            # Quantization error against the bf16 weights it came from.
            errs = [float((dequantize(tensors[k], tensors[k + "_scale_inv"]) - hub[k].float()).norm()
                          / hub[k].float().norm()) for k in tensors if tensors[k].dtype == FP8]
            bf16_model = load_f32(bf16_dir)
            bf16_move = float((mf.teacher_forced(bf16_model, ids) - mf.teacher_forced(reference, ids)).abs().max())

            if out.exists():
                shutil.rmtree(out)
            out.mkdir(parents=True)
            shutil.copyfile(fp8_dir / "config.json", out / "config.json")
            shutil.copyfile(fp8_dir / "model.safetensors", out / "model.safetensors")
            summary = check_fixture(out, reference, keep_f32)
            cpu = transformers_fp8_cpu(out, prompt, opts["steps"], rows)

        expected = dict(
            prompt_ids=prompt,
            generated_ids=generated,
            logits=[r.tolist() for r in rows],
            seed=seed,
            min_top2_gap=gap,
            config_layout=layout,
            min_router_gap=router_gap,
            bias_changed_share=bias_share,
            fp8=dict(
                weight_block_size=[BLOCK, BLOCK],
                scale_dtype=SAFETENSORS_DTYPE[opts["scale_dtype"]],
                fp8_tensors=summary["fp8_count"],
                max_relative_quantization_error=max(errs),
                logit_move_from_bf16_weights=bf16_move,
                logit_move_when_scales_misread=effects,
                logit_move_when_f32_rounded_to_bf16=rounding,
            ),
            exact_tolerance=F32_TOLERANCE if rounding is not None else None,
            transformers_version=transformers.__version__,
            torch_version=torch.__version__,
        )
        (out / "expected.json").write_text(json.dumps(expected) + "\n")
        report(name, out, summary, expected, rows, errs, cpu)
        return
    sys.exit(f"{name}: no seed gave a top-2 gap of {mf.MIN_TOP2_GAP}")


def report(name, out, summary, expected, rows, errs, cpu):
    fp8 = expected["fp8"]
    extra = "" if expected["min_router_gap"] is None else f", min router gap {expected['min_router_gap']:.4f}"
    if expected["bias_changed_share"] is not None:
        extra += f", bias changes {expected['bias_changed_share']:.0%} of selections"
    print(f"{name}: seed {expected['seed']}, {len(rows)} rows, min top-2 gap {expected['min_top2_gap']:.4f}"
          f"{extra}, max |logit| {max(float(r.abs().max()) for r in rows):.3f}")
    print(f"  {summary['fp8_count']} F8_E4M3 weights, scales {summary['scale_dtypes']}, "
          f"{summary['codes']} distinct fp8 codes, quantization error (relative) "
          f"{min(errs):.4f}..{max(errs):.4f}; bf16 weights instead move logits by "
          f"{fp8['logit_move_from_bf16_weights']:.4f}")
    if fp8["logit_move_when_f32_rounded_to_bf16"] is not None:
        print(f"  F32 tensors rounded to bf16 move logits by {fp8['logit_move_when_f32_rounded_to_bf16']:.4f}")
    print("  misread scales move logits by " + ", ".join(
        f"{k} {v:.4f}" if v is not None else f"{k} n/a" for k, v in fp8["logit_move_when_scales_misread"].items()))
    print(f"  transformers' FP8 loading on the CPU: {cpu}")
    print(f"  dequantized file == reference weights; {(out / 'model.safetensors').stat().st_size} bytes")
    for k in summary["names"]:
        if ".layers." not in k or ".layers.0." in k and not re.search(r"\.experts\.[1-9]", k):
            print(f"    {k:<58} {summary['dtypes'][k]:<8} {list(summary['tensors'][k].shape)}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    root = Path(__file__).resolve().parent.parent / "tests"
    ap.add_argument("--out", default=str(root / "fixtures"))
    ap.add_argument("cases", nargs="*", help="cases to make (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    transformers.logging.disable_progress_bar()
    for name in args.cases or list(CASES):
        if name not in CASES:
            sys.exit(f"unknown case {name}; known: {', '.join(CASES)}")
        make_case(name, Path(args.out))


if __name__ == "__main__":
    main()
