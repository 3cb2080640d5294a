"""Writes tests/fixtures/formats/blocks.gguf: for every weight format, a
matrix `w.<TYPE>` of random blocks and `y.<TYPE>`, its values as the `gguf`
package's `dequantize` gives them (F32). The Rust tests check the CPU and
GPU decodings against these bit for bit.

Block bytes are random except the f16 scales, which are finite (one in
eight subnormal, some negative) so that every value is a number.

The types: BF16, F16, F32, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K,
Q5_K, Q6_K, then FP8 (below), then IQ4_NL (blocks of 32 values: f16 `d`,
16 bytes of 4-bit indices into the non-linear table) and IQ4_XS (blocks of
256: f16 `d`, 6-bit sub-block scales as u16 `scales_h` and 4 bytes
`scales_l`, 128 bytes of indices), then the lower i-quants (IQ2_XXS,
IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S: a leading f16 `d`; IQ1_M: `d` in
the top nibbles of its four u16 scales) and MXFP4 (its e8m0 scale byte
kept in 100 .. 154, so that values are normal and finite). Types added
later come later in the file and in the random stream, so the earlier
matrices keep the bytes they had.

FP8 (`w.F8_E4M3`, stored as I8 bytes) is in the engine's row blocks of 128
values, each an f32 scale and 128 float8_e4m3fn bytes, on rows of
FP8_COLS values (the last block partial, zero-padded); its values are
ml_dtypes' float8_e4m3fn decoding times the scale, in f32. Every byte but
the two NaN codes occurs.

    python3 -m venv /tmp/gv && /tmp/gv/bin/pip install gguf numpy ml_dtypes
    # gguf 0.19.0 (with IQ4_NL / IQ4_XS in gguf.quants) wrote the file
    /tmp/gv/bin/python scripts/make_format_fixtures.py
"""
from pathlib import Path

import numpy as np
import gguf
import ml_dtypes
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

ROWS, COLS = 5, 512
# Byte offsets of the f16 scales in each block type's file layout.
SCALES = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
    T.IQ4_NL: [0], T.IQ4_XS: [0],
    T.IQ2_XXS: [0], T.IQ2_XS: [0], T.IQ2_S: [0], T.IQ3_XXS: [0], T.IQ3_S: [0], T.IQ1_S: [0],
    T.IQ1_M: [], T.MXFP4: [],
}
# Drawn after FP8, so that adding them left the earlier matrices as they were.
AFTER_FP8 = [T.IQ4_NL, T.IQ4_XS, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M,
             T.MXFP4]


def random_scales(rng, n):
    v = (rng.standard_normal(n) * 0.02).astype(np.float16)
    tiny = rng.random(n) < 0.125
    v[tiny] = (rng.standard_normal(tiny.sum()) * 2e-6).astype(np.float16)  # f16 subnormals
    return v


def blocks(rng, ty):
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[ty]
    if ty == T.F32:
        return rng.standard_normal((ROWS, COLS)).astype(np.float32)
    if ty == T.F16:
        return (rng.standard_normal((ROWS, COLS)) * 0.5).astype(np.float16)
    if ty == T.BF16:
        bits = (rng.standard_normal((ROWS, COLS)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        return bits.view(np.uint8).reshape(ROWS, COLS * 2)
    n = ROWS * COLS // block_elems
    b = rng.integers(0, 256, size=(n, block_bytes), dtype=np.uint8)
    for at in SCALES[ty]:
        b[:, at:at + 2] = random_scales(rng, n).view(np.uint8).reshape(n, 2)
    if ty == T.IQ1_M:
        # d's four nibbles are the top nibbles of the u16 scales at 48 .. 56.
        d = random_scales(rng, n).view(np.uint16).astype(np.uint16)
        sc = b[:, 48:56].copy().view(np.uint16) & np.uint16(0x0FFF)
        for i in range(4):
            sc[:, i] |= ((d >> np.uint16(4 * i)) & np.uint16(0xF)) << np.uint16(12)
        b[:, 48:56] = sc.view(np.uint8)
    if ty == T.MXFP4:
        b[:, 0] = rng.integers(100, 155, size=n, dtype=np.uint8)
    return b.reshape(ROWS, COLS // block_elems * block_bytes)


FP8_COLS = 500
FP8_BLOCK = 128


def fp8_blocks(rng):
    """Row blocks of random FP8 bytes with their scales, and the values."""
    blocks = -(-FP8_COLS // FP8_BLOCK)
    finite = np.array([b for b in range(256) if b & 0x7f != 0x7f], dtype=np.uint8)
    q = rng.choice(finite, size=(ROWS, FP8_COLS))
    scales = (rng.standard_normal((ROWS, blocks)) * 0.01).astype(np.float32)
    padded = np.zeros((ROWS, blocks * FP8_BLOCK), dtype=np.uint8)
    padded[:, :FP8_COLS] = q
    raw = np.concatenate(
        [scales.reshape(ROWS, blocks, 1).view(np.uint8), padded.reshape(ROWS, blocks, FP8_BLOCK)], axis=2
    ).reshape(ROWS, -1)
    decoded = q.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    values = decoded * np.repeat(scales, FP8_BLOCK, axis=1)[:, :FP8_COLS]
    assert np.isfinite(values).all()
    return raw, values.astype(np.float32)


def add_blocks(w, rng, ty):
    data = blocks(rng, ty)
    raw = data if data.dtype == np.uint8 else data.view(np.uint8)
    values = dequantize(raw, ty).astype(np.float32).reshape(ROWS, COLS)
    assert np.isfinite(values).all()
    w.add_tensor(f"w.{ty.name}", raw, raw_shape=raw.shape, raw_dtype=ty)
    w.add_tensor(f"y.{ty.name}", values)


def main():
    rng = np.random.default_rng(2026)
    out = Path(__file__).resolve().parent.parent / "tests/fixtures/formats/blocks.gguf"
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(out), arch="formats")
    for ty in [T.BF16, T.F16, T.F32, *(t for t in SCALES if t not in AFTER_FP8)]:
        add_blocks(w, rng, ty)
    raw, values = fp8_blocks(rng)
    w.add_tensor("w.F8_E4M3", raw, raw_shape=raw.shape, raw_dtype=T.I8)
    w.add_tensor("y.F8_E4M3", values)
    for ty in AFTER_FP8:
        add_blocks(w, rng, ty)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
