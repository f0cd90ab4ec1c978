"""Decode attention on this CPU: one query per row, grouped-query heads, bf16 (what models/attention.py `attention`
decides). For each geometry, batch size and KV length: torch's SDPA with `enable_gqa` (the query heads of one KV
head as separate heads), against the same SDPA call with each KV head's G query heads folded into the query
length ([B, Hkv, G, D]), and whether the two results are equal bit for bit. Rows of a batch attend to prefixes
of different lengths (a mask), as in the engine; a single row has none.

Geometries: the built-in model (8 query / 4 KV heads, D=32), qwen3-30b-a3b (32 / 4, D=128), Mixtral (32 / 8,
D=128), and DeepSeek-V2's absorbed MLA (16 query heads over one latent: scores on 576 dims, values 512).

    python benchmarks/attention.py [--threads 2] [--reps 50]
Prints a table and writes results/attention.json.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.common import machine_state, median_time, print_table, write_json
from moepager.models.attention import attention

GEOMETRIES = {  # query heads, KV heads, key dim, value dim
    "demo-moe": (8, 4, 32, 32),
    "qwen3-30b-a3b": (32, 4, 128, 128),
    "mixtral-8x7b": (32, 8, 128, 128),
    "deepseek-v2 (MLA)": (16, 1, 576, 512),
}


def inputs(b: int, h: int, hkv: int, dk: int, dv: int, s: int, gen: torch.Generator):
    q = torch.randn(b, h, 1, dk, generator=gen).bfloat16()
    k = torch.randn(b, hkv, s, dk, generator=gen).bfloat16()
    v = torch.randn(b, hkv, s, dv, generator=gen).bfloat16()
    lengths = torch.randint(s // 2, s + 1, (b,), generator=gen)
    lengths[0] = s
    mask = (torch.arange(s)[None, :] < lengths[:, None])[:, None, None, :] if b > 1 else None
    return q, k, v, mask


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=50)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    state = machine_state()
    gen = torch.Generator().manual_seed(0)
    rows = []
    with torch.inference_mode():
        for name, (h, hkv, dk, dv) in GEOMETRIES.items():
            for b in (1, 8):
                for s in (64, 512, 2048):
                    q, k, v, mask = inputs(b, h, hkv, dk, dv, s, gen)
                    def expanded():
                        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

                    def folded():
                        return attention(q, k, v, mask)
                    for fn in (expanded, folded):
                        fn()  # warm-up
                    t_gqa = median_time(expanded, args.reps)
                    t_fold = median_time(folded, args.reps)
                    a, c = expanded(), folded()
                    rows.append({"geometry": name, "rows": b, "kv_len": s, "enable_gqa_us": 1e6 * t_gqa,
                                 "folded_us": 1e6 * t_fold, "speedup": t_gqa / t_fold, "bit_equal": torch.equal(a, c),
                                 "max_abs_diff": (a.float() - c.float()).abs().max().item()})
    print_table(["geometry", "rows", "KV len", "enable_gqa us", "folded us", "speedup", "bit-equal", "max |diff|"],
                [[r["geometry"], r["rows"], r["kv_len"], r["enable_gqa_us"], r["folded_us"], f"{r['speedup']:.1f}x",
                  r["bit_equal"], f"{r['max_abs_diff']:.1e}"] for r in rows])
    path = write_json("attention", {"machine": state, "args": vars(args), "rows": rows})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
