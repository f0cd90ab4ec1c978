"""Threads on a busy machine: the built-in model's decode tok/s with the default threads (the cores other processes
leave idle), all cores, one thread, and all cores with passive OpenMP waiting, on an idle machine and beside one
process that keeps a core busy. Each setting is a fresh `moepager generate` process (greedy, 64 tokens), interleaved
over --rounds rounds; medians.

    python -m benchmarks run threads [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import machine_state, print_table, write_json

CORES = os.cpu_count() or 1
SETTINGS = {  # label -> (--threads, extra environment)
    "default": (None, {}),
    f"--threads {CORES}": (CORES, {}),
    "--threads 1": (1, {}),
    f"--threads {CORES}, OMP_WAIT_POLICY=PASSIVE": (CORES, {"OMP_WAIT_POLICY": "PASSIVE"}),
}


def decode_tok_s(threads: int | None, env: dict[str, str], stats: Path) -> float:
    argv = [sys.executable, "-m", "moepager.cli.main", "generate", "--quiet", "--max-tokens", "64", "--ignore-eos",
            "--temperature", "0", "--stats-json", str(stats), "The history of"]
    argv += ["--threads", str(threads)] if threads is not None else []
    subprocess.run(argv, env={**os.environ, **env}, capture_output=True, check=True)
    return json.loads(stats.read_text())["decode_tokens_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    state = machine_state()
    rows, results = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        stats = Path(tmp) / "stats.json"
        for busy in (False, True):
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
            try:
                time.sleep(0.5)
                runs: dict[str, list[float]] = {label: [] for label in SETTINGS}
                for _ in range(args.rounds):
                    for label, (threads, env) in SETTINGS.items():
                        runs[label].append(decode_tok_s(threads, env, stats))
            finally:
                if hog is not None:
                    hog.kill()
            machine = "one core busy" if busy else "idle"
            results[machine] = {label: statistics.median(v) for label, v in runs.items()}
            rows += [[machine, label, v] for label, v in results[machine].items()]
    print_table(["machine", "threads", "decode tok/s"], rows)
    print(f"wrote {write_json('threads', {'machine': state, 'rounds': args.rounds, 'tok_s': results})}")


if __name__ == "__main__":
    main()
