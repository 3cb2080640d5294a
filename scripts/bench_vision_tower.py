"""The reference for `bench --shape qwen3-vl-8b-4l`'s vision-tower figure:
transformers' Qwen3-VL vision tower (Qwen3-VL-8B's vision_config, random
weights) on the same GPU, for one square image of SIDE pixels cut as
Qwen3-VL's processor cuts it (16-pixel patches, 2 frames, 2 x 2 merge).
Prints the best of REPS forward passes after a warm-up, in bf16 and f32.

usage: python3 scripts/bench_vision_tower.py [SIDE] [REPS]   (needs torch with CUDA, transformers)
"""
import sys
import time

import torch
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

side = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 5
config = Qwen3VLVisionConfig(
    depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, in_channels=3, patch_size=16,
    spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=4096, num_position_embeddings=2304,
    deepstack_visual_indexes=[8, 16, 24], hidden_act="gelu_pytorch_tanh",
)
grid = side // 16
patch_len = 3 * 2 * 16 * 16
print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; {side} x {side} image: {grid * grid} patches")
for dtype in (torch.bfloat16, torch.float32):
    for attn in ("sdpa", "eager"):
        config._attn_implementation = attn
        torch.manual_seed(0)
        model = Qwen3VLVisionModel._from_config(config, torch_dtype=dtype).to("cuda").eval()
        pixels = torch.randn(grid * grid, patch_len, dtype=dtype, device="cuda")
        grid_thw = torch.tensor([[1, grid, grid]], device="cuda")
        times = []
        with torch.no_grad():
            for i in range(reps + 1):
                torch.cuda.synchronize()
                start = time.perf_counter()
                model(pixels, grid_thw=grid_thw)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
        print(f"transformers vision tower, {str(dtype).removeprefix('torch.')}, {attn}: {min(times[1:]) * 1e3:.2f} ms")
        del model
