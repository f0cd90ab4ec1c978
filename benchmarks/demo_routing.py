"""Does the built-in demo model route like a real MoE? Expert-use skew and token-to-token locality of the demo
model on its validation text, next to the real DeepSeek-V2-Lite trace (../shared/traces/deepseek-v2-lite).

The demo model's trace is recorded by the engine's recorder (`LLM.generate(record_trace=PATH)`) over the
validation documents of scripts/train_demo_model.py's split (first --tokens tokens of each, one prefill pass).
Per layer: entropy of expert use (and as a share of the uniform maximum), share of choices taken by the top
quarter of experts, and the rate at which a token reuses the previous token's experts (uniform: K/E).
Usage: python benchmarks/demo_routing.py [--trace-out PATH] [--tokens 256]
(writes results/demo_routing.json and results/demo_routing.png)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.common import RESULTS, SHARED, converted, demo_documents, record_demo_trace, write_json
from moepager.trace.stats import RoutingStats, format_stats, routing_stats


def plot(rows: dict[str, RoutingStats], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, stats in rows.items():
        x = [i / max(1, len(stats.layers) - 1) for i in range(len(stats.layers))]
        axes[0].plot(x, [r.entropy_ratio for r in stats.layers], marker="o", label=name)
        line = axes[1].plot(x, [r.repeat_rate for r in stats.layers], marker="o", label=name)[0]
        axes[1].axhline(stats.repeat_rate_random, color=line.get_color(), linestyle=":", linewidth=1)
    axes[0].set(title="expert-use entropy / uniform maximum", xlabel="relative layer depth", ylim=(0, 1.02))
    axes[1].set(title="same expert as previous token (dotted: uniform K/E)", xlabel="relative layer depth",
                ylim=(0, None))
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace-out", type=Path, default=RESULTS / "traces" / "demo-moe-valid.mpt",
                    help="where the engine's recorder writes the demo model's validation trace")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per validation document")
    args = ap.parse_args()
    args.trace_out.unlink(missing_ok=True)
    record_demo_trace(args.trace_out, demo_documents()[1], args.tokens)
    deepseek = converted("deepseek-csv", SHARED / "deepseek-v2-lite", "deepseek-v2-lite")
    rows = {"demo-moe (validation text)": routing_stats(str(args.trace_out)),
            "DeepSeek-V2-Lite (real trace)": routing_stats(str(deepseek))}
    for stats in rows.values():
        print(format_stats(stats), end="\n\n")
    print("| model | experts | entropy / max | top-quarter share | repeat rate | uniform repeat |")
    print("|---|---|---|---|---|---|")
    for name, s in rows.items():
        print(f"| {name} | top-{s.top_k} of {s.num_experts} | {s.mean('entropy_ratio'):.1%} | "
              f"{s.mean('top_quarter_share'):.1%} | {s.mean('repeat_rate'):.1%} | {s.repeat_rate_random:.1%} |")
    png = RESULTS / "demo_routing.png"
    plot(rows, png)
    path = write_json("demo_routing", {name: s.to_json() for name, s in rows.items()})
    print(f"wrote {path} and {png}")


if __name__ == "__main__":
    main()
