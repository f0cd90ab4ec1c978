"""Deterministic overhead of a decode step on the built-in model: moepager-level Python calls per decode token
(the architecture review's method: a 17-token generation less a 1-token one, over 16 steps), all resident, at a
25% budget, and at 25% with gate-lookahead prefetch; and all resident with the compiled decode step
(`--compile`). Issue 15's goals: <= 40 resident, <= 80 with a predictor.
tests/runtime/test_overhead.py guards the same counts.

    python benchmarks/overhead.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import machine_state, print_table, write_json  # noqa: E402
from moepager.config import EngineConfig, PrefetchConfig, StoreConfig  # noqa: E402
from moepager.runtime.llm import LLM  # noqa: E402
from tests.runtime.test_overhead import calls_per_decode_token  # noqa: E402

PAGED = StoreConfig(expert_memory="25%", direct_io="off")
CONFIGS = {
    "all resident": EngineConfig(),
    "all resident, --compile": EngineConfig(compile=True),
    "25% budget": EngineConfig(store=PAGED),
    "25% budget + gate-lookahead": EngineConfig(store=PAGED, prefetch=PrefetchConfig("gate-lookahead")),
}


def main() -> None:
    rows = []
    for label, config in CONFIGS.items():
        llm = LLM(config=config, show_progress=False)
        rows.append({"config": label, "calls_per_decode_token": calls_per_decode_token(llm)})
    print_table(["configuration", "moepager Python calls / decode token"],
                [[r["config"], r["calls_per_decode_token"]] for r in rows])
    print(f"wrote {write_json('overhead', {'machine': machine_state(), 'rows': rows})}")


if __name__ == "__main__":
    main()
