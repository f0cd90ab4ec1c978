"""CPU: experts paged from disk under 100/50/25/12.5% budgets, on replayed DeepSeek-V2-Lite routing.

Every configuration (budget x policy lru/lfu/lcp x predictor none/transition/expert-map) replays the same real
requests on a deepseek-v2-lite-geometry checkpoint (8 MoE layers by default: 8.9 GB of experts, what this
24 GiB machine holds all-resident beside the rest and replays in ~15 minutes); experts are read with O_DIRECT,
so the page cache holds none. Prints decode tok/s, ratio to all-resident, hit rate, disk bytes per token,
exposed load time per token, prefetch accuracy and the calibrated cost model's TPOT next to the measured one;
then TTFT at a 512-token prompt. Writes results/offload_cpu.json and .png. See benchmarks/offload_replay.py.

    python benchmarks/offload_cpu.py [--layers 8] [--threads 2] [--requests 2] [--prompt 16] [--decode 48]
"""

from __future__ import annotations

from benchmarks.offload_replay import main

if __name__ == "__main__":
    main("cpu", layers=8, threads=2, name="offload_cpu")
