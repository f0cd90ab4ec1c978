"""GPU: experts paged host->device under 100/50/25/12.5% device budgets, on replayed DeepSeek-V2-Lite routing.

The CPU benchmark's matrix (benchmarks/offload_replay.py) with `--device cuda`: the deepseek-v2-lite geometry
with all 26 MoE layers by default (29 GB of experts in pinned host RAM, a budget of them on the GPU), the
same replayed requests for every configuration, the calibrated model (H2D from pinned memory as the link)
beside the measured TPOT, and TTFT at a 512-token prompt. Needs CUDA. Writes results/offload_gpu.json/.png.

    python benchmarks/offload_gpu.py [--layers 26] [--requests 2] [--prompt 16] [--decode 48]
"""

from __future__ import annotations

import sys

import torch

from benchmarks.offload_replay import main

if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("offload_gpu.py needs CUDA")
    main("cuda", layers=26, threads=None, name="offload_gpu")
