"""Writes tests/fixtures/tokenizers/spm.gguf and spm.json (and
spm_model.gguf, a tiny random Llama that uses the vocabulary): a SentencePiece
BPE vocabulary (byte fallback on, identity normalization, a dummy space
prefix, as Llama 2's and Mistral's tokenizers are) trained on a small
corpus, stored as llama.cpp's converter stores a `llama` tokenizer
(tokens, scores, token types; no merges), and the ids SentencePiece itself
gives a set of texts. The Rust test builds the tokenizer from the GGUF and
checks it encodes each text to those ids and decodes them back.

    python3 -m venv /tmp/gv && /tmp/gv/bin/pip install gguf numpy sentencepiece
    /tmp/gv/bin/python scripts/make_spm_fixture.py
"""
import io
import json
from pathlib import Path

import gguf
import sentencepiece as spm

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "tokenizers"

CORPUS = """The quick brown fox jumps over the lazy dog.
A tokenizer splits text into pieces; the model sees only their ids.
Paris is the capital of France, and Berlin is the capital of Germany.
In 1969, 600 million people watched the landing on the Moon.
Les élèves étudient la physique à l'école.
def main():
    print("hello, world")
    return 0
Numbers like 3.14159 and 2.71828 appear in mathematics.
Tokenizers, tokenization and tokens: the same stem, three words.
"""

TEXTS = [
    "Hello world",
    "The capital of France is",
    " leading space",
    "two  spaces and   three",
    "tabs\tand\nnew lines\n",
    "digits 1234567890 and 3.14",
    "accents: café, naïve, élève",
    "unseen characters: 日本語 and 🙂 fall back to bytes",
    "tokenization tokenizers",
    "",
]


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.splitlines() * 4),
        model_writer=model,
        model_type="bpe",
        vocab_size=420,
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        num_threads=1,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())

    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        if sp.is_unknown(i):
            types.append(gguf.TokenType.UNKNOWN)
        elif sp.is_control(i):
            types.append(gguf.TokenType.CONTROL)
        elif sp.is_unused(i):
            types.append(gguf.TokenType.UNUSED)
        elif sp.is_byte(i):
            types.append(gguf.TokenType.BYTE)
        else:
            types.append(gguf.TokenType.NORMAL)

    w = gguf.GGUFWriter(str(OUT / "spm.gguf"), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_bos_token(True)
    w.add_add_space_prefix(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    cases = [{"text": t, "ids": sp.encode(t), "decoded": sp.decode(sp.encode(t))} for t in TEXTS]
    expected = {"bos_id": sp.bos_id(), "cases": cases}
    (OUT / "spm.json").write_text(json.dumps(expected, indent=1, ensure_ascii=False) + "\n")
    write_model(OUT / "spm.gguf", OUT / "spm_model.gguf")


def write_model(tokenizer_file, path):
    """A tiny random Llama (2 layers, 64 wide, f32) over the
    tokenizer of `tokenizer_file`: a model that speaks this vocabulary, for
    the CLI's text output."""
    import numpy as np

    reader = gguf.GGUFReader(str(tokenizer_file))
    w = gguf.GGUFWriter(str(path), "llama")
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            kind = field.types[0]
            sub = field.types[1] if kind == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, field.contents(), kind, sub_type=sub)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    hidden, ffn, layers, heads, kv_heads, head_dim = 64, 128, 2, 4, 2, 16
    w.add_block_count(layers)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    rng = np.random.default_rng(7)

    def matrix(rows, cols):
        # ggml order: the contiguous (column) dimension first.
        return (rng.standard_normal((rows, cols)) * 1.5 / cols ** 0.5).astype(np.float32)

    w.add_tensor("token_embd.weight", (rng.standard_normal((vocab, hidden))).astype(np.float32))
    for i in range(layers):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(b + "attn_q.weight", matrix(heads * head_dim, hidden))
        w.add_tensor(b + "attn_k.weight", matrix(kv_heads * head_dim, hidden))
        w.add_tensor(b + "attn_v.weight", matrix(kv_heads * head_dim, hidden))
        w.add_tensor(b + "attn_output.weight", matrix(hidden, heads * head_dim))
        w.add_tensor(b + "ffn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(b + "ffn_gate.weight", matrix(ffn, hidden))
        w.add_tensor(b + "ffn_up.weight", matrix(ffn, hidden))
        w.add_tensor(b + "ffn_down.weight", matrix(hidden, ffn))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    # Output rows of the byte, control and unknown pieces scaled down: the
    # model writes whole pieces, most of them words with their leading space.
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    output = matrix(vocab, hidden) * 4.0
    output[[i for i, t in enumerate(types) if t != gguf.TokenType.NORMAL]] *= 0.05
    w.add_tensor("output.weight", output)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
