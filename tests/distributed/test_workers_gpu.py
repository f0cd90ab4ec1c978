"""A main rank on CUDA with its routed experts on CPU worker processes (gloo: each layer's input and routing go to the
host and the workers' rows come back). Its tokens are those of `--execution cpu-experts` on the same GPU: the dense
part on the GPU, every expert on the CPU with the same kernels, at the same thread count.

Runs only with `python -m pytest -m gpu` on a machine with CUDA.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def generate(*options: str) -> str:
    cmd = [sys.executable, "-m", "moepager.cli.main", "generate", "--device", "cuda", "--threads", "1", "--max-tokens",
           "12", "--temperature", "0", "--ignore-eos", *options, "The history of"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.split("\n\nprompts ")[0]  # the text, without the statistics table


@pytest.mark.parametrize("shadow", [False, True], ids=["workers", "workers-and-shadow"])
def test_a_main_rank_on_cuda_with_cpu_workers_gives_the_cpu_experts_tokens(shadow):
    alone = generate("--execution", "cpu-experts")
    spread = generate("--workers", "2", *(["--shadow"] if shadow else []))
    assert spread.startswith("The history of") and spread == alone
