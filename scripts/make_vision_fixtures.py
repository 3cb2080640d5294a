#!/usr/bin/env python3
"""Writes the image preprocessing fixtures under tests/fixtures/vision/:
images of several sizes and kinds (RGB, gray, palette and alpha PNGs, JPEGs,
one with an EXIF rotation) and, for each, what transformers' Qwen2-VL image
processor (PIL backend, the processor Qwen3-VL ships with) makes of it when
given the file as Pillow opens it, turned upright.

  python scripts/make_vision_fixtures.py [--out tests/fixtures/vision]

Per case NAME: NAME.png or NAME.jpg, and in cases.json its processor
settings, the RGB bytes transformers decodes (NAME.rgb), the patch grid and
the pixel values (NAME.f32, little-endian float32, one row per patch).
Needs transformers, Pillow and numpy; seeds are fixed.
"""
import argparse
import json
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps
import transformers
from transformers.image_transforms import convert_to_rgb
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

# Qwen3-VL's preprocessor_config.json, with pixel ranges small enough for
# fixtures (one case keeps the shipped least of 65 536 pixels).
QWEN3_VL = dict(patch_size=16, temporal_patch_size=2, merge_size=2,
                image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
SMALL = dict(QWEN3_VL, size=dict(shortest_edge=32 * 32, longest_edge=96 * 160))


def noise(rng, h, w, channels):
    """Smooth blobs and noise, so that resampling has edges and gradients."""
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([np.sin(x / (3 + 5 * c) + y / (7 + 2 * c)) for c in range(channels)], -1)
    v = 127.5 + 90 * base + rng.normal(0, 25, (h, w, channels))
    return np.clip(v, 0, 255).astype(np.uint8)


def cases(rng):
    rgb = lambda h, w: Image.fromarray(noise(rng, h, w, 3), "RGB")
    out = {
        # Upscaled to the least pixels; downscaled to the most; an odd size
        # rounded to the merged patch.
        "rgb_small_up": (rgb(17, 23), SMALL, "png"),
        "rgb_down": (rgb(300, 200), SMALL, "png"),
        "rgb_odd": (rgb(75, 101), SMALL, "png"),
        "rgb_wide": (rgb(20, 700), SMALL, "png"),
        "rgb_shipped_least": (rgb(40, 60), dict(QWEN3_VL, size=dict(shortest_edge=65536, longest_edge=16777216)), "png"),
        "clip_defaults": (rgb(90, 70), dict(size=dict(shortest_edge=56 * 56, longest_edge=112 * 112)), "png"),
        "gray": (Image.fromarray(noise(rng, 50, 64, 1)[:, :, 0], "L"), SMALL, "png"),
    }
    rgba = noise(rng, 48, 40, 4)
    rgba[:, :, 3] = rng.integers(0, 256, (48, 40))
    rgba[:4, :, 3] = 0
    rgba[4:8, :, 3] = 255
    out["rgba"] = (Image.fromarray(rgba, "RGBA"), SMALL, "png")
    la = noise(rng, 33, 45, 2)
    out["gray_alpha"] = (Image.fromarray(la, "LA"), SMALL, "png")
    pal = rgb(40, 52).quantize(colors=37)
    pal.info["transparency"] = 5
    out["palette_transparent"] = (pal, SMALL, "png")
    out["jpeg"] = (rgb(120, 90), SMALL, "jpg")
    out["jpeg_exif_rotated"] = (rgb(64, 96), SMALL, "jpg-rot")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/fixtures/vision")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(7)
    meta = dict(transformers_version=transformers.__version__, pillow_version=Image.__version__, cases={})
    for name, (image, settings, kind) in cases(rng).items():
        if kind == "png":
            path = out / f"{name}.png"
            image.save(path, transparency=image.info["transparency"]) if "transparency" in image.info else image.save(path)
        else:
            path = out / f"{name}.jpg"
            exif = None
            if kind == "jpg-rot":
                exif = Image.Exif()
                exif[0x0112] = 6  # rotated 90 degrees clockwise
            image.save(path, quality=90, **({"exif": exif} if exif is not None else {}))
        # Opened as Pillow opens it, upright: the processor then makes it RGB,
        # compositing any transparency onto white (as qwen-vl-utils does too;
        # transformers' load_image would drop the alpha channel instead).
        loaded = ImageOps.exif_transpose(Image.open(path))
        processor = Qwen2VLImageProcessorPil(**settings)
        result = processor(images=[loaded], return_tensors="np")
        values = result["pixel_values"].astype(np.float32)
        grid = [int(v) for v in result["image_grid_thw"][0]]

        decoded = np.asarray(convert_to_rgb(loaded, return_numpy=True), dtype=np.uint8)
        (out / f"{name}.rgb").write_bytes(decoded.tobytes())
        (out / f"{name}.f32").write_bytes(values.astype("<f4").tobytes())
        meta["cases"][name] = dict(
            file=path.name, processor=settings, decoded_size=[decoded.shape[0], decoded.shape[1]],
            grid=grid, patch_len=int(values.shape[1]),
        )
        print(f"{name}: {image.size[0]} x {image.size[1]} {image.mode} -> grid {grid}, {values.shape[0]} patches")
    (out / "cases.json").write_text(json.dumps(meta, indent=1) + "\n")


if __name__ == "__main__":
    main()
