#!/usr/bin/env python3
"""Writes src/format/grids.rs: the lattices ("grids") of ggml's i-quants,
read from the `gguf` Python package (gguf.quants), each as one u16 per
entry holding the entry's element codes, lowest element in the lowest
bits, and the values the codes stand for.

    /tmp/gv/bin/python scripts/make_format_grids.py   # gguf 0.19.0
"""
from math import ceil, log2
from pathlib import Path

import numpy as np
from gguf import quants

OUT = Path(__file__).resolve().parent.parent / "src/format/grids.rs"
GRIDS = [
    ("IQ2XXS_GRID", quants.IQ2_XXS, "IQ2_XXS"),
    ("IQ2XS_GRID", quants.IQ2_XS, "IQ2_XS"),
    ("IQ2S_GRID", quants.IQ2_S, "IQ2_S"),
    ("IQ3XXS_GRID", quants.IQ3_XXS, "IQ3_XXS"),
    ("IQ3S_GRID", quants.IQ3_S, "IQ3_S"),
    ("IQ1S_GRID", quants.IQ1_S, "IQ1_S and IQ1_M"),
]


def entries(cls):
    """Each entry's codes as a u16: gguf's grid_hex is exactly these, as hex
    bytes, little-endian."""
    raw = np.frombuffer(cls.grid_hex, dtype=np.uint8).reshape(-1, 2)
    nibbles = np.where(raw > 0x40, raw + 9, raw) & 0x0F
    data = (nibbles[:, 0] << 4) | nibbles[:, 1]
    rows, cols = cls.grid_shape
    # Codes of 2 bits, or of 3 in 4-bit slots.
    bits = 8 // (8 // ceil(log2(len(cls.grid_map))))
    assert cols * bits == 16, cls
    entries = data.astype(np.uint8).view("<u2")
    for j in range(cols):
        assert ((entries >> (bits * j)) & ((1 << bits) - 1)).max() < len(cls.grid_map), cls
    return entries.tolist(), bits


def main():
    out = ["//! The i-quants' lattices (ggml's `iq2xxs_grid` ... `iq1s_grid`), written by",
           "//! scripts/make_format_grids.py from the `gguf` package. Do not edit.", "",
           "use super::Grid;", ""]
    for name, cls, types in GRIDS:
        values, bits = entries(cls)
        rows, cols = cls.grid_shape
        assert len(values) == rows
        out.append(f"/// {types}: {rows} entries of {cols} values, {bits}-bit codes.")
        out.append(f"pub const {name}: Grid = Grid {{")
        out.append(f"    bits: {bits},")
        out.append(f"    values: &{list(int(v) for v in cls.grid_map)},")
        out.append("    entries: &[")
        for i in range(0, rows, 12):
            out.append("        " + ", ".join(f"0x{v:04x}" for v in values[i:i + 12]) + ",")
        out.append("    ],")
        out.append("};")
        out.append("")
    OUT.write_text("\n".join(out))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
