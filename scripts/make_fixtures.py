#!/usr/bin/env python3
"""Generates the conformance fixtures under tests/fixtures/ with transformers.

Each case is a tiny random model: config.json, model.safetensors (bf16) and
expected.json (prompt_ids, generated_ids, logits). Logits are computed on the
CPU in float32 over the bf16-rounded weights, with eager attention, by a model
reloaded from the written folder, so the config as written (either layout) is
what transformers interpreted.

  python scripts/make_fixtures.py [--out tests/fixtures] [CASE ...] [--steering [CASE ...]]

Steering cases (tests/steering/) add control vector files and the logits and
layer outputs of transformers with forward hooks that apply them.

Needs torch and transformers (CPU is enough). Seeds are fixed; for each case
the first seed whose greedy choices all win by a clear margin is kept, so f32
rounding cannot flip an id.
"""
import argparse
import copy
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


def llama_linear_rope():
    # Llama 2's linear RoPE scaling in its legacy spelling (`type`, not
    # `rope_type`): positions divided by the factor.
    return "hub", dict(
        architectures=["LlamaForCausalLM"], model_type="llama",
        hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
        rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=dict(type="linear", factor=4.0),
        vocab_size=250, max_position_embeddings=512, tie_word_embeddings=False,
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


def qwen3_dense():
    # Per-head q/k norm, tied embeddings, head_dim 24 != 64 / 4.
    return "v5", dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3",
        hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24,
        rms_norm_eps=1e-6, vocab_size=211, max_position_embeddings=128,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        tie_word_embeddings=True, use_sliding_window=False, sliding_window=4,
    )


def qwen3_yarn():
    # YaRN as Qwen3's long-context recipe writes it in the hub layout, with
    # every optional parameter away from its default: betas 16 / 2, an
    # untruncated ramp, the attention factor from mscale / mscale_all_dim.
    return "hub", dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3",
        hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        rms_norm_eps=1e-6, vocab_size=205, max_position_embeddings=256, rope_theta=1000000.0,
        rope_scaling=dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=32,
                          beta_fast=16.0, beta_slow=2.0, truncate=False, mscale=1.0, mscale_all_dim=0.5),
        tie_word_embeddings=False,
    )


def mistral3_text():
    # Mistral Small 3.1's class: the Mistral language model in text_config,
    # a Pixtral tower (unused by text prompts) beside it.
    vocab = 200
    return "hub", dict(
        architectures=["Mistral3ForConditionalGeneration"], model_type="mistral3",
        text_config=dict(
            model_type="mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5,
            vocab_size=vocab, max_position_embeddings=128, rope_theta=1000000000.0,
            sliding_window=None, tie_word_embeddings=False,
        ),
        vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, head_dim=16, image_size=64, patch_size=16),
        image_token_id=vocab - 1, spatial_merge_size=2, tie_word_embeddings=False,
    )


def mixtral_8x2():
    return "hub", dict(
        architectures=["MixtralForCausalLM"], model_type="mixtral",
        hidden_size=64, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=8, num_experts_per_tok=2,
        rms_norm_eps=1e-5, rope_theta=1000000.0, vocab_size=190,
        max_position_embeddings=128, tie_word_embeddings=False, sliding_window=None,
    )


def mixtral_deep():
    # Four MoE layers: steering a layer's output changes the routing of the
    # layers after it.
    cfg = mixtral_8x2()[1]
    cfg.update(num_hidden_layers=4)
    return "hub", cfg


def mixtral_kv1_top3():
    # One KV head, top-3 of 6 experts, fused expert tensors.
    return "v5-fused", dict(
        architectures=["MixtralForCausalLM"], model_type="mixtral",
        hidden_size=48, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=3, num_key_value_heads=1,
        num_local_experts=6, num_experts_per_tok=3,
        rms_norm_eps=1e-5, rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        vocab_size=150, max_position_embeddings=128, tie_word_embeddings=False,
    )


def qwen3_moe(norm_topk_prob):
    return dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=1, mlp_only_layers=[],
        rms_norm_eps=1e-6, rope_theta=1000000.0, vocab_size=230,
        max_position_embeddings=128, tie_word_embeddings=False, use_sliding_window=False,
    )


def qwen3_moe_norm():
    return "v5-fused", qwen3_moe(True)


def qwen3_moe_no_norm():
    return "hub", qwen3_moe(False)


def qwen3_moe_dense_layers():
    # Layers 1 and 3 are sparse by decoder_sparse_step = 2; mlp_only_layers
    # makes layer 3 dense again: MoE only in layer 1.
    cfg = qwen3_moe(True)
    cfg.update(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3], num_experts_per_tok=3)
    return "hub", cfg


def minimax_m2():
    # Partial rotary (16 of 32 dims), whole-projection q/k norm, sigmoid
    # routing with a correction bias that changes many selections.
    return "hub", dict(
        architectures=["MiniMaxM2ForCausalLM"], model_type="minimax_m2",
        hidden_size=64, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rotary_dim=16,
        num_local_experts=8, num_experts_per_tok=2, scoring_func="sigmoid", use_routing_bias=True,
        rms_norm_eps=1e-6, rope_theta=5000000.0, vocab_size=180, bos_token_id=1, eos_token_id=2,
        max_position_embeddings=128, tie_word_embeddings=False,
    )


# name -> (config builder, options). `must_matter` lists config changes that
# must change the logits: proof that the feature under test is exercised and
# that transformers read the field from the layout as written.
def qwen3_vl_vision(out_hidden):
    # A tower the text-only cases carry but never run.
    return dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=8,
                spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=out_hidden,
                num_position_embeddings=16, deepstack_visual_indexes=[0])


# Qwen3-VL's special ids: the last four of each vocabulary (text cases never use them).
def qwen3_vl_ids(vocab):
    return dict(image_token_id=vocab - 4, video_token_id=vocab - 3,
                vision_start_token_id=vocab - 2, vision_end_token_id=vocab - 1)


def qwen3_vl_dense():
    # transformers 5's own layout: text_config with rope_parameters (M-RoPE
    # sections), tied embeddings.
    vocab = 230
    return "v5", dict(
        architectures=["Qwen3VLForConditionalGeneration"], model_type="qwen3_vl",
        text_config=dict(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            rms_norm_eps=1e-6, vocab_size=vocab, max_position_embeddings=256,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0,
                                 mrope_section=[2, 3, 3], mrope_interleaved=True),
            tie_word_embeddings=True,
        ),
        vision_config=qwen3_vl_vision(64), tie_word_embeddings=True, **qwen3_vl_ids(vocab),
    )


def qwen3_vl_moe():
    # The hub's layout as Qwen3-VL-30B-A3B ships: rope_scaling and
    # rope_theta inside text_config, experts fused as [E, in, out].
    vocab = 240
    return "hub-transposed-experts", dict(
        architectures=["Qwen3VLMoeForConditionalGeneration"], model_type="qwen3_vl_moe",
        text_config=dict(
            model_type="qwen3_vl_moe_text",
            hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=1, head_dim=24,
            rms_norm_eps=1e-6, vocab_size=vocab, max_position_embeddings=256,
            rope_theta=5000000.0,
            rope_scaling=dict(rope_type="default", mrope_section=[4, 4, 4], mrope_interleaved=True),
            num_experts=6, num_experts_per_tok=2, moe_intermediate_size=40,
            decoder_sparse_step=1, mlp_only_layers=[1], tie_word_embeddings=False,
        ),
        vision_config=qwen3_vl_vision(64), tie_word_embeddings=False, **qwen3_vl_ids(vocab),
    )


CASES = {
    "llama_untied": (llama_untied, dict(prompt_len=12, steps=8, must_matter=[
        dict(rope_theta=10000.0),
    ])),
    "llama3_tied": (llama3_tied, dict(prompt_len=12, steps=8, must_matter=[
        dict(rope_parameters=dict(rope_type="default", rope_theta=500000.0)),
    ])),
    "llama_linear_rope": (llama_linear_rope, dict(prompt_len=12, steps=8, must_matter=[
        dict(rope_scaling=None),
    ])),
    "mistral_window": (mistral_window, dict(prompt_len=12, steps=8, must_matter=[
        dict(sliding_window=None),
        dict(rope_theta=10000.0),
    ])),
    "qwen3_dense": (qwen3_dense, dict(prompt_len=12, steps=8, must_matter=[
        dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    ])),
    "qwen3_yarn": (qwen3_yarn, dict(prompt_len=12, steps=8, must_matter=[
        dict(rope_scaling=None),
        dict(rope_scaling=dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=32,
                               beta_fast=16.0, beta_slow=2.0, truncate=True, mscale=1.0, mscale_all_dim=0.5)),
        dict(rope_scaling=dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=32,
                               beta_fast=16.0, beta_slow=2.0, truncate=False)),
    ])),
    "mistral3_text": (mistral3_text, dict(prompt_len=12, steps=8, must_matter=[])),
    "mixtral_8x2": (mixtral_8x2, dict(prompt_len=12, steps=8, must_matter=[
        dict(num_experts_per_tok=1),
    ])),
    "mixtral_deep": (mixtral_deep, dict(prompt_len=12, steps=8, must_matter=[
        dict(num_experts_per_tok=1),
    ])),
    "mixtral_kv1_top3": (mixtral_kv1_top3, dict(prompt_len=12, steps=8, must_matter=[
        dict(num_experts_per_tok=2),
    ])),
    "qwen3_moe_norm": (qwen3_moe_norm, dict(prompt_len=12, steps=8, must_matter=[
        dict(norm_topk_prob=False),
    ])),
    "qwen3_moe_no_norm": (qwen3_moe_no_norm, dict(prompt_len=12, steps=8, must_matter=[
        dict(norm_topk_prob=True),
    ])),
    "qwen3_moe_dense_layers": (qwen3_moe_dense_layers, dict(prompt_len=12, steps=8, must_matter=[])),
    "minimax_m2": (minimax_m2, dict(prompt_len=12, steps=8, must_matter=[
        dict(rotary_dim=32),
    ], bias_scale=0.15)),
    "qwen3_vl_dense": (qwen3_vl_dense, dict(prompt_len=12, steps=8, must_matter=[
        dict(text_config={**qwen3_vl_dense()[1]["text_config"],
                          "rope_parameters": dict(rope_type="default", rope_theta=10000.0,
                                                  mrope_section=[2, 3, 3], mrope_interleaved=True)}),
    ])),
    "qwen3_vl_moe": (qwen3_vl_moe, dict(prompt_len=12, steps=8, must_matter=[
        dict(text_config={**qwen3_vl_moe()[1]["text_config"], "num_experts_per_tok": 1}),
    ])),
    # Several prefill chunks long.
    "llama_long_prompt": (llama_untied, dict(prompt_len=100, steps=6, must_matter=[
        dict(rope_theta=10000.0),
    ])),
    "mixtral_long_prompt": (mixtral_8x2, dict(prompt_len=100, steps=6, must_matter=[
        dict(num_experts_per_tok=1),
    ])),
}

MIN_ROUTER_GAP = 2e-3  # between the k-th and (k+1)-th selection score


def randomize(model, seed, bias_scale=0.0):
    """Weights wide enough that logits are well separated; norm weights away from 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # RMSNorm weights
                p.copy_(torch.empty(p.shape).uniform_(0.5, 1.5, generator=g))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=g) * (1.5 / fan_in ** 0.5))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                # Same order of magnitude as the sigmoid scores' spread, so
                # the bias decides many selections.
                b.copy_(torch.randn(b.shape, generator=g) * bias_scale)
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


def model_class(cfg_dict):
    """The class transformers loads a checkpoint of this config as."""
    if cfg_dict["model_type"] == "qwen3_vl":
        return transformers.Qwen3VLForConditionalGeneration
    if cfg_dict["model_type"] == "qwen3_vl_moe":
        return transformers.Qwen3VLMoeForConditionalGeneration
    if cfg_dict["model_type"] == "mistral3":
        return transformers.Mistral3ForConditionalGeneration
    return AutoModelForCausalLM


def from_config(cfg_dict, config):
    """A float32 model of `config` with transformers' initial weights."""
    cls = model_class(cfg_dict)
    if cls is AutoModelForCausalLM:
        return cls.from_config(config, dtype=torch.float32)
    return cls(config).to(torch.float32)


def reserved_ids(cfg_dict):
    """Ids a text case's prompt and generation must not hold (Qwen3-VL's vision tokens)."""
    return {v for k, v in cfg_dict.items() if k.endswith("_token_id")}


def vocab_size(config):
    return config.get_text_config().vocab_size


def build(cfg_dict):
    # A copy: transformers edits nested dicts (rope parameters) in place.
    cfg_kwargs = {k: copy.deepcopy(v) for k, v in cfg_dict.items() if k not in ("architectures", "model_type")}
    config = AutoConfig.for_model(cfg_dict["model_type"], **cfg_kwargs)
    config.architectures = cfg_dict["architectures"]
    config._attn_implementation = "eager"
    return config


def teacher_forced(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def check_features_matter(name, cfg_dict, changes, weights, ids):
    base = build(cfg_dict)
    ref = from_config(cfg_dict, base)
    ref.load_state_dict(weights)
    want = teacher_forced(ref, ids)
    for change in changes:
        model = from_config(cfg_dict, build({**cfg_dict, **change}))
        model.load_state_dict(weights)
        diff = float((teacher_forced(model, ids) - want).abs().max())
        if diff < 1e-2:
            sys.exit(f"{name}: changing {change} moves logits by only {diff}: the case does not test it")


class RouterProbe:
    """Records every router's selection scores during a forward pass."""

    def __init__(self, model, cfg_dict):
        self.scores, self.unbiased = [], []
        self.k = cfg_dict.get("num_experts_per_tok", 0)
        sigmoid = cfg_dict.get("scoring_func") == "sigmoid"
        self.handles = [
            module.register_forward_hook(self.hook(sigmoid), with_kwargs=True)
            for module in model.modules() if type(module).__name__.endswith("TopKRouter")
        ]

    def remove(self):
        for handle in self.handles:
            handle.remove()

    def hook(self, sigmoid):
        def record(module, args, kwargs, output):
            logits = output[0].float()
            if sigmoid:
                bias = args[1] if len(args) > 1 else kwargs["e_score_correction_bias"]
                s = torch.sigmoid(logits)
                self.scores.append(s + bias.float())
                self.unbiased.append(s)
            else:
                self.scores.append(torch.softmax(logits, dim=-1))
        return record

    def min_gap(self):
        gaps = [torch.sort(s, dim=-1, descending=True).values for s in self.scores]
        return min(float((v[:, self.k - 1] - v[:, self.k]).min()) for v in gaps)

    def bias_changed_share(self):
        changed = total = 0
        for s, u in zip(self.scores, self.unbiased):
            biased = torch.topk(s, self.k, dim=-1).indices.sort(dim=-1).values
            plain = torch.topk(u, self.k, dim=-1).indices.sort(dim=-1).values
            changed += int((biased != plain).any(dim=-1).sum())
            total += s.shape[0]
        return changed / max(total, 1)


def top2_gap(rows):
    return min(float(torch.topk(r, 2).values[0] - torch.topk(r, 2).values[1]) for r in rows)


def write_fused(path, model):
    """The fused 3-D expert layout transformers 5 holds in memory
    (mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I])."""
    from safetensors.torch import save_file
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(path), metadata={"format": "pt"})


def transpose_experts(path):
    """Rewrites the fused expert tensors as the hub ships Qwen3-VL-MoE:
    gate_up_proj [E, H, 2I] and down_proj [E, I, H] (transformers 5 holds and
    writes [E, 2I, H] and [E, H, I], and transposes the hub's on load)."""
    from safetensors.torch import load_file, save_file
    state = load_file(str(path))
    for name in list(state):
        if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            state[name] = state[name].transpose(1, 2).contiguous()
    save_file(state, str(path), metadata={"format": "pt"})


def write_config(path, layout, cfg_dict, saved_config):
    if layout.startswith("v5"):
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
        model = from_config(cfg_dict, config)
        randomize(model, seed, opts.get("bias_scale", 0.0))

        g = torch.Generator().manual_seed(10_000 + seed)
        reserved = reserved_ids(cfg_dict)
        prompt = torch.randint(0, vocab_size(config) - len(reserved), (opts["prompt_len"],), generator=g).tolist()

        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
        write_config(out / "config.json", layout, cfg_dict, model.config)

        if layout == "hub-transposed-experts":
            transpose_experts(out / "model.safetensors")
        reloaded = model_class(cfg_dict).from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
        reloaded.eval()
        generated, rows = greedy_rows(reloaded, prompt, opts["steps"])
        gap = top2_gap(rows)
        if gap < MIN_TOP2_GAP or reserved & set(generated):
            continue
        router_gap = bias_share = None
        if "num_experts_per_tok" in cfg_dict.get("text_config", cfg_dict):
            probe = RouterProbe(reloaded, cfg_dict.get("text_config", cfg_dict))
            teacher_forced(reloaded, prompt + generated[:-1])
            router_gap = probe.min_gap()
            if router_gap < MIN_ROUTER_GAP:
                continue
            if cfg_dict.get("scoring_func") == "sigmoid":
                bias_share = probe.bias_changed_share()
                if not 0.3 <= bias_share <= 0.8:
                    continue
        check_features_matter(name, cfg_dict, opts["must_matter"], reloaded.state_dict(),
                              prompt + generated[:-1])
        if layout == "v5-fused":
            write_fused(out / "model.safetensors", reloaded)
            refused = model_class(cfg_dict).from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
            again, again_rows = greedy_rows(refused, prompt, opts["steps"])
            assert again == generated and all(torch.equal(a, b) for a, b in zip(again_rows, rows)), \
                f"{name}: the fused layout does not reload to the same model"
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
            min_router_gap=router_gap,
            bias_changed_share=bias_share,
            transformers_version=transformers.__version__,
            torch_version=torch.__version__,
        )
        (out / "expected.json").write_text(json.dumps(expected) + "\n")
        extra = "" if router_gap is None else f", min router gap {router_gap:.4f}"
        extra += "" if bias_share is None else f", bias changes {bias_share:.0%} of selections"
        print(f"{name}: seed {seed}, {len(rows)} rows, min top-2 gap {gap:.4f}{extra}, layout {layout}")
        return
    sys.exit(f"{name}: no seed gave a top-2 gap of {MIN_TOP2_GAP}")


# Control vectors. Each steering case runs a fixture case above with two
# control vector files: one in the layout of llama.cpp's cvector-generator
# (int32 layer_count, ascending direction.N) and one in repeng's (uint32
# layer_count, descending). transformers' logits come from forward hooks
# that add strength * direction.N to decoder layer N's output; the same
# hooks record every layer's output after steering (what capture returns).
STEERING_CASES = {
    "mistral_window": dict(steps=8, strengths=(1.0, -0.7), one_layer=2),
    "mixtral_deep": dict(steps=8, strengths=(1.0, -0.7), one_layer=2),
}


def write_control_vector(path, directions, model_hint, layout):
    import gguf
    import numpy as np
    w = gguf.GGUFWriter(str(path), "controlvector")
    w.add_string("controlvector.model_hint", model_hint)
    if layout == "llama.cpp":
        w.add_int32("controlvector.layer_count", len(directions))
        order = sorted(directions)
    else:
        w.add_uint32("controlvector.layer_count", len(directions))
        order = sorted(directions, reverse=True)
    for layer in order:
        w.add_tensor(f"direction.{layer}", directions[layer].numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


class LayerHooks:
    """Adds a vector to chosen decoder layers' outputs; records every layer's output."""

    def __init__(self, model):
        self.add = {}
        self.outputs = {}
        for i, layer in enumerate(model.model.layers):
            layer.register_forward_hook(self.hook(i))

    def hook(self, i):
        def steer(module, args, output):
            hs = output[0] if isinstance(output, tuple) else output
            if i in self.add:
                hs = hs + self.add[i]
            self.outputs[i] = hs[0].detach().clone()
            return (hs,) + tuple(output[1:]) if isinstance(output, tuple) else hs
        return steer


def steered_run(model, hooks, prompt, steps, add):
    """Greedy rows as greedy_rows, and each layer's captured rows: every
    prompt position, then each decoded token."""
    hooks.add = add
    ids = list(prompt)
    rows, generated = [], []
    capture = None
    with torch.no_grad():
        for step in range(steps + 1):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            layer_rows = [hooks.outputs[i] for i in sorted(hooks.outputs)]
            new = [r if step == 0 else r[-1:] for r in layer_rows]
            capture = new if capture is None else [torch.cat([c, n]) for c, n in zip(capture, new)]
            rows.append(logits)
            nxt = int(torch.argmax(logits))
            generated.append(nxt)
            ids.append(nxt)
    hooks.add = {}
    return generated, rows, capture


def make_steering_case(name, fixtures_root, out_root):
    opts = STEERING_CASES[name]
    base = fixtures_root / name
    expected_base = json.loads((base / "expected.json").read_text())
    prompt = expected_base["prompt_ids"]
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    hooks = LayerHooks(model)
    plain_ids, plain_rows, plain_capture = steered_run(model, hooks, prompt, opts["steps"], {})
    assert plain_ids == expected_base["generated_ids"], f"{name}: unsteered run differs from its fixture"
    n_layers = model.config.num_hidden_layers
    hidden = model.config.hidden_size
    # Per-element scale of each layer's output: directions of that size
    # visibly steer the model.
    scale = [float(c.pow(2).mean().sqrt()) for c in plain_capture]
    is_moe = hasattr(model.config, "num_experts_per_tok")
    a_strength, b_strength = opts["strengths"]
    k = opts["one_layer"]
    for seed in range(1000):
        g = torch.Generator().manual_seed(20_000 + seed)
        a = {n: torch.randn(hidden, generator=g) * scale[n] for n in range(1, n_layers)}
        b = {n: torch.randn(hidden, generator=g) * scale[n] for n in range(1, n_layers)}
        runs = [
            dict(name="two_files_all_layers", vectors=[["llama_cpp.gguf", a_strength], ["repeng.gguf", b_strength]],
                 layer_range=None,
                 add={n: a_strength * a[n] + b_strength * b[n] for n in range(1, n_layers)}),
            dict(name="one_layer", vectors=[["llama_cpp.gguf", 1.5]], layer_range=[k, k],
                 add={k: 1.5 * a[k]}),
        ]
        ok = True
        for run in runs:
            probe = RouterProbe(model, model.config.to_dict()) if is_moe else None
            ids, rows, capture = steered_run(model, hooks, prompt, opts["steps"], run.pop("add"))
            if ids == plain_ids or top2_gap(rows) < MIN_TOP2_GAP:
                ok = False
                break
            if probe is not None:
                gap = probe.min_gap()
                probe.remove()
                if gap < MIN_ROUTER_GAP:
                    ok = False
                    break
            run.update(generated_ids=ids, logits=[r.tolist() for r in rows],
                       capture=[c.tolist() for c in capture], min_top2_gap=top2_gap(rows))
        if not ok:
            continue
        out = out_root / name
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        write_control_vector(out / "llama_cpp.gguf", a, model.config.model_type, "llama.cpp")
        write_control_vector(out / "repeng.gguf", b, model.config.model_type, "repeng")
        expected = dict(
            base=name, prompt_ids=prompt, prompt_rows=len(prompt), runs=runs, seed=seed,
            unsteered_capture=[c.tolist() for c in plain_capture],
            transformers_version=transformers.__version__, torch_version=torch.__version__,
        )
        (out / "expected.json").write_text(json.dumps(expected) + "\n")
        print(f"steering {name}: seed {seed}, " + ", ".join(
            f"{r['name']} gap {r['min_top2_gap']:.4f}" for r in runs))
        return
    sys.exit(f"steering {name}: no direction seed changed the greedy ids with clear margins")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    root = Path(__file__).resolve().parent.parent / "tests"
    ap.add_argument("--out", default=str(root / "fixtures"))
    ap.add_argument("--steering-out", default=str(root / "steering"))
    ap.add_argument("cases", nargs="*", help="fixture cases to make (default: all)")
    ap.add_argument("--steering", nargs="*", default=None,
                    help="steering cases to make (default: all when no fixture case is named)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    cases = args.cases if args.cases or args.steering is not None else list(CASES)
    if args.steering is not None:
        steering = args.steering or list(STEERING_CASES)
    else:
        steering = [] if args.cases else list(STEERING_CASES)
    for name in cases:
        make_case(name, Path(args.out))
    for name in steering:
        make_steering_case(name, Path(args.out), Path(args.steering_out))


if __name__ == "__main__":
    main()
