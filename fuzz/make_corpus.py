#!/usr/bin/env python3
"""Writes the fuzz targets' seed corpora (fuzz/corpus/<target>/) from the
repository's fixtures, small enough for a fuzzer to mutate quickly:

- config_json: every fixture's config.json;
- safetensors_header: fixture checkpoints cut to their norms and a
  cropped projection, an FP8 projection cropped to partial blocks with its
  scale grid (f32 and bf16 scales);
- shard_index: shard indexes naming the shard the target puts beside them;
- gguf_model: every GGUF fixture cut to layer 0, each tensor's rows cropped
  (data kept consistent: whole rows of the stored blocks), the quantized
  tensors of the block-format fixture, the SentencePiece
  tokenizer fixture's metadata on a llama model, a GPT-2 byte-level
  tokenizer, Llama 3 rope divisors;
- gguf_control_vector: the control-vector fixtures;
- tokenizer_json: small tokenizer.json files of each model kind (BPE,
  byte-level BPE, WordPiece, Unigram, WordLevel) and their stages.

  python3 fuzz/make_corpus.py

Standard library only. The output is deterministic; file names are the
SHA-1 of the contents, as libFuzzer names the inputs it adds.
"""
import hashlib
import json
import struct
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
CORPUS = ROOT / "fuzz" / "corpus"

# ---------------------------------------------------------------- output


def write(target, data):
    if isinstance(data, str):
        data = data.encode()
    folder = CORPUS / target
    folder.mkdir(parents=True, exist_ok=True)
    (folder / hashlib.sha1(data).hexdigest()).write_bytes(data)


# ---------------------------------------------------------------- config.json


def config_json():
    for path in sorted(FIXTURES.glob("*/config.json")):
        write("config_json", path.read_bytes())


# ---------------------------------------------------------------- safetensors

DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1}


def read_safetensors(path):
    b = path.read_bytes()
    n = struct.unpack("<Q", b[:8])[0]
    header = json.loads(b[8:8 + n])
    meta = header.pop("__metadata__", None)
    tensors = {}
    for name, info in header.items():
        lo, hi = info["data_offsets"]
        tensors[name] = (info["dtype"], info["shape"], b[8 + n + lo:8 + n + hi])
    return meta, tensors


def safetensors_bytes(meta, tensors):
    header, offset, data = {}, 0, b""
    if meta is not None:
        header["__metadata__"] = meta
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        data += raw
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def crop_matrix(raw, shape, width, rows, cols):
    """Rows 0..rows, columns 0..cols of a row-major [r, c] matrix."""
    c = shape[1]
    return b"".join(raw[r * c * width:(r * c + cols) * width] for r in range(rows))


def safetensors_header():
    for case in ["llama_untied", "qwen3_dense"]:
        meta, tensors = read_safetensors(FIXTURES / case / "model.safetensors")
        kept = {k: v for k, v in tensors.items() if "layers.1" not in k and len(v[2]) <= 1024}
        k = "model.layers.0.self_attn.k_proj.weight"
        dtype, shape, raw = tensors[k]
        kept[k] = (dtype, [4, shape[1]], crop_matrix(raw, shape, 2, 4, shape[1]))
        write("safetensors_header", safetensors_bytes(meta, kept))
    # An FP8 projection cropped to partial blocks (a row of two column
    # blocks; two row blocks of a few columns), its scale grid in f32 and
    # in bf16.
    meta, tensors = read_safetensors(FIXTURES / "fp8_partial_blocks" / "model.safetensors")
    q = "model.layers.0.self_attn.q_proj.weight"
    dtype, shape, raw = tensors[q]
    scale_dtype, scale_shape, scale_raw = tensors[q + "_scale_inv"]
    assert scale_dtype == "F32" and scale_shape == [2, 2]
    scales = [scale_raw[i:i + 4] for i in range(0, 16, 4)]
    for (rows, cols), grid in [((2, 130), [0, 1]), ((129, 4), [0, 2])]:
        for bf16 in [False, True]:
            scale = b"".join(scales[i][2:] if bf16 else scales[i] for i in grid)
            grid_shape = [-(-rows // 128), -(-cols // 128)]
            kept = {k: v for k, v in tensors.items() if "norm" in k}
            kept[q] = (dtype, [rows, cols], crop_matrix(raw, shape, 1, rows, cols))
            kept[q + "_scale_inv"] = ("BF16" if bf16 else "F32", grid_shape, scale)
            write("safetensors_header", safetensors_bytes(meta, kept))


# ---------------------------------------------------------------- shard index


def shard_index():
    _, tensors = read_safetensors(FIXTURES / "llama_untied" / "model.safetensors")
    write("shard_index", json.dumps({
        "metadata": {"total_size": 189000},
        "weight_map": {"model.norm.weight": "model.safetensors", "lm_head.weight": "model.safetensors"},
    }))
    write("shard_index", json.dumps({
        "metadata": {"total_size": sum(len(t[2]) for t in tensors.values())},
        "weight_map": {name: "model.safetensors" for name in sorted(tensors)},
    }, indent=2))


# ---------------------------------------------------------------- GGUF

FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
# ggml type id -> (elements, bytes) per block
BLOCK = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
         9: (32, 36), 10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210),
         15: (256, 292), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8), 30: (1, 2)}
ALIGN = 32


def read_gguf(path):
    """(version, [(key, raw key-value bytes)], [(name, dims, type, data)])."""
    b = path.read_bytes()
    pos = 0

    def take(n):
        nonlocal pos
        pos += n
        return b[pos - n:pos]

    u32 = lambda: struct.unpack("<I", take(4))[0]
    u64 = lambda: struct.unpack("<Q", take(8))[0]
    string = lambda: take(u64()).decode()

    def skip(ty):
        if ty in FIXED:
            take(FIXED[ty])
        elif ty == 8:
            string()
        elif ty == 9:
            elem, n = u32(), u64()
            for _ in range(n):
                skip(elem)

    assert take(4) == b"GGUF"
    version, n_tensors, n_kv = u32(), u64(), u64()
    meta = []
    for _ in range(n_kv):
        start = pos
        key = string()
        skip(u32())
        meta.append((key, b[start:pos]))
    infos = []
    for _ in range(n_tensors):
        name = string()
        dims = [u64() for _ in range(u32())]
        infos.append((name, dims, u32(), u64()))
    data_start = -(-pos // ALIGN) * ALIGN
    tensors = []
    for name, dims, ty, offset in infos:
        elements, block_bytes = BLOCK[ty]
        n = 1
        for d in dims:
            n *= d
        start = data_start + offset
        tensors.append((name, dims, ty, b[start:start + n // elements * block_bytes]))
    return version, meta, tensors


def gguf_string(s):
    s = s.encode()
    return struct.pack("<Q", len(s)) + s


def meta_kv(key, ty, value):
    """A metadata entry (key, its bytes): ty 4 u32, 5 i32, 6 f32, 7 bool, 8 string, or
    ("array", element type, values)."""
    out = gguf_string(key)
    if isinstance(ty, tuple):
        _, elem, values = ty
        out += struct.pack("<IIQ", 9, elem, len(values))
        for v in values:
            out += gguf_string(v) if elem == 8 else struct.pack({4: "<I", 5: "<i", 6: "<f"}[elem], v)
        return (key, out)
    fmt = {4: "<I", 5: "<i", 6: "<f", 7: "<?"}
    out += struct.pack("<I", ty) + (gguf_string(value) if ty == 8 else struct.pack(fmt[ty], value))
    return (key, out)


def gguf_bytes(version, meta, tensors):
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(meta))
    out += b"".join(raw for _, raw in meta)
    offset = 0
    for name, dims, ty, data in tensors:
        out += gguf_string(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", ty, offset)
        offset = -(-(offset + len(data)) // ALIGN) * ALIGN
    for _, _, _, data in tensors:
        out += b"\0" * (-len(out) % ALIGN) + data
    return out


def crop_rows(tensor, rows):
    """At most `rows` rows of each matrix of a ggml tensor (dims[0] is
    contiguous, dims[1] the rows, dims[2] the experts)."""
    name, dims, ty, data = tensor
    if len(dims) < 2 or dims[1] <= rows:
        return tensor
    elements, block_bytes = BLOCK[ty]
    row_bytes = dims[0] // elements * block_bytes
    matrix = dims[1] * row_bytes
    matrices = len(data) // matrix
    data = b"".join(data[m * matrix:m * matrix + rows * row_bytes] for m in range(matrices))
    return (name, [dims[0], rows] + dims[2:], ty, data)


def cut_model(tensors):
    """Layer 0 of a model, each matrix cropped to a row or a few, without
    the f32 norms of 256 values the parsers read nothing more from."""
    kept = []
    for name, dims, ty, data in tensors:
        if name.startswith("blk.") and not name.startswith("blk.0."):
            continue
        if name.startswith("blk.0.") and name.endswith(("attn_norm.weight", "ffn_norm.weight")):
            continue
        rows = {"token_embd.weight": 4, "output.weight": 2}.get(name, 1)
        kept.append(crop_rows((name, dims, ty, data), rows))
    return kept


def replace_meta(meta, entries):
    keys = {key for key, _ in entries}
    return [m for m in meta if m[0] not in keys] + entries


def byte_level_alphabet():
    """GPT-2's byte-to-character map."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in range(256)]


def gguf_model():
    models = sorted(FIXTURES.glob("gguf_*/model.gguf"))
    cut = {}
    for path in models:
        version, meta, tensors = read_gguf(path)
        cut[path.parent.name] = (version, meta, cut_model(tensors))
        write("gguf_model", gguf_bytes(version, meta, cut[path.parent.name][2]))
    version, meta, tensors = read_gguf(FIXTURES / "formats" / "blocks.gguf")
    write("gguf_model", gguf_bytes(version, meta, [crop_rows(t, 1) for t in tensors if t[0].startswith("w.")]))

    # The SentencePiece tokenizer fixture, alone and on a llama model.
    spm = FIXTURES / "tokenizers" / "spm.gguf"
    write("gguf_model", spm.read_bytes())
    _, spm_meta, _ = read_gguf(spm)
    version, meta, tensors = cut["gguf_llama_q4_k_m"]
    tokenizer = [m for m in spm_meta if m[0].startswith("tokenizer.")]
    write("gguf_model", gguf_bytes(version, replace_meta(meta, tokenizer), tensors))

    # A GPT-2 byte-level BPE tokenizer (SmolLM's pre-tokenizer), a chat
    # template, Llama 3 rope divisors, on a Qwen3 model.
    alphabet = byte_level_alphabet()
    merges = ["a b", "H e", "He l", "Hel l", "Hell o", "\u0120 w", "\u0120w o", "1 2"]
    words = ["ab", "He", "Hel", "Hell", "Hello", "\u0120w", "\u0120wo", "12"]
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = special + alphabet + words
    types = [3] * len(special) + [1] * (len(alphabet) + len(words))
    gpt2 = [
        meta_kv("tokenizer.ggml.model", 8, "gpt2"),
        meta_kv("tokenizer.ggml.pre", 8, "smollm"),
        meta_kv("tokenizer.ggml.tokens", ("array", 8, tokens), None),
        meta_kv("tokenizer.ggml.token_type", ("array", 5, types), None),
        meta_kv("tokenizer.ggml.merges", ("array", 8, merges), None),
        meta_kv("tokenizer.ggml.bos_token_id", 4, 1),
        meta_kv("tokenizer.ggml.eos_token_id", 4, 2),
        meta_kv("tokenizer.chat_template", 8,
                "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"),
    ]
    version, meta, tensors = cut["gguf_qwen3_q4_0"]
    write("gguf_model", gguf_bytes(version, replace_meta(meta, gpt2), tensors))
    version, meta, tensors = cut["gguf_llama_q8_0_tied"]
    freqs = struct.pack("<32f", *[1.0 + i / 4 for i in range(32)])
    scaling = [meta_kv("llama.rope.scaling.type", 8, "linear"), meta_kv("llama.rope.scaling.factor", 6, 2.0),
               meta_kv("llama.attention.sliding_window", 4, 64)]
    write("gguf_model", gguf_bytes(version, replace_meta(meta, scaling),
                                   tensors + [("rope_freqs.weight", [32], 0, freqs)]))


# ---------------------------------------------------------------- control vectors


def gguf_control_vector():
    for path in sorted((ROOT / "tests" / "steering").glob("*/*.gguf")):
        write("gguf_control_vector", path.read_bytes())


# ---------------------------------------------------------------- tokenizer.json


def tokenizer_json():
    added = [{"id": 3, "content": "<s>", "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True}]
    # tests/fuzz.rs's seed.
    write("tokenizer_json", json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u2581"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]},
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "\\s+|[a-z]+"}, "behavior": "Isolated",
                          "invert": False},
        "post_processor": None, "decoder": None,
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": False,
                  "vocab": {"<unk>": 0, "a": 1, "b": 2, "<s>": 3, "ab": 4, "\u2581": 5},
                  "merges": [["a", "b"]]},
    }, ensure_ascii=False))
    # Byte-level BPE as GPT-2 / SmolLM ship it.
    alphabet = byte_level_alphabet()
    vocab = {"<|endoftext|>": 0}
    for c in alphabet:
        vocab[c] = len(vocab)
    for w in ["ab", "He", "ll", "Hell", "Hello", "\u0120w", "\u0120wo"]:
        vocab[w] = len(vocab)
    write("tokenizer_json", json.dumps({
        "version": "1.0",
        "truncation": {"direction": "Right", "max_length": 512, "strategy": "LongestFirst", "stride": 0},
        "padding": {"strategy": {"Fixed": 16}, "direction": "Left", "pad_to_multiple_of": 8, "pad_id": 0,
                    "pad_type_id": 0, "pad_token": "<|endoftext|>"},
        "added_tokens": [{"id": 0, "content": "<|endoftext|>", "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
                           "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab,
                  "merges": ["a b", "H e", "l l", "He ll", "Hell o", "\u0120 w", "\u0120w o"]},
    }, ensure_ascii=False))
    # SentencePiece BPE with byte fallback and a BOS template.
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab["<0x%02X>" % b] = len(vocab)
    for w in ["\u2581", "a", "b", "H", "e", "l", "o", "w", "r", "d", "ab", "\u2581H", "ll", "\u2581He", "\u2581Hello"]:
        vocab[w] = len(vocab)
    write("tokenizer_json", json.dumps({
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, t in enumerate(["<unk>", "<s>", "</s>"])],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u2581"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]},
        "pre_tokenizer": None,
        "post_processor": {"type": "TemplateProcessing",
                           "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                      {"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                    {"Sequence": {"id": "A", "type_id": 0}},
                                    {"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab,
                  "merges": [["a", "b"], ["l", "l"], ["\u2581", "H"], ["\u2581H", "e"]]},
    }, ensure_ascii=False))
    # WordPiece with BERT's normalizer and pre-tokenizer.
    vocab = {t: i for i, t in enumerate(
        ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b", "ab", "##b", "##a", "hello", "world", "1", "##2"])}
    write("tokenizer_json", json.dumps({
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": vocab[t], "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for t in ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]],
        "normalizer": {"type": "BertNormalizer", "clean_text": True, "handle_chinese_chars": True,
                       "strip_accents": None, "lowercase": True},
        "pre_tokenizer": {"type": "BertPreTokenizer"},
        "post_processor": {"type": "BertProcessing", "sep": ["[SEP]", 3], "cls": ["[CLS]", 2]},
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": True},
        "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
                  "max_input_chars_per_word": 100, "vocab": vocab},
    }))
    # Unigram with the Metaspace pre-tokenizer.
    pieces = [["<unk>", 0.0], ["\u2581", -1.0], ["a", -2.0], ["b", -2.5], ["ab", -1.5], ["\u2581ab", -1.2],
              ["H", -3.0], ["ello", -2.0], ["\u2581w", -2.2], ["orld", -2.1], ["1", -3.0], ["2", -3.0]]
    write("tokenizer_json", json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Nmt"},
            {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "}]},
        "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always",
                          "split": True},
        "post_processor": None,
        "decoder": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": True},
        "model": {"type": "Unigram", "unk_id": 0, "vocab": pieces, "byte_fallback": False},
    }, ensure_ascii=False))
    # WordLevel over whitespace and punctuation.
    write("tokenizer_json", json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
        "normalizer": {"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "Lowercase"},
                                                            {"type": "StripAccents"}, {"type": "Strip",
                                                                                       "strip_left": True,
                                                                                       "strip_right": True}]},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "WhitespaceSplit"}, {"type": "Punctuation", "behavior": "Isolated"},
            {"type": "Split", "pattern": {"String": "-"}, "behavior": "Removed", "invert": False}]},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "ab": 1, "ba": 2, "hello": 3, "world": 4},
                  "unk_token": "[UNK]"},
    }))


if __name__ == "__main__":
    config_json()
    safetensors_header()
    shard_index()
    gguf_model()
    gguf_control_vector()
    tokenizer_json()
    for folder in sorted(CORPUS.iterdir()):
        files = list(folder.iterdir())
        print(f"{folder.name}: {len(files)} seeds, {sum(f.stat().st_size for f in files)} bytes")
