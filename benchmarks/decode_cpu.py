"""HF transformers vs moepager on the CPU: prefill and decode tokens/s at 1 and 2 threads, side by side.

Model: `make-model --preset olmoe-1b-7b --layers 4` in bf16 (64 experts, top-8, H=2048). Both engines are
loaded once and measured alternately in the same run; each number is the median of --reps repetitions.
Prefill: one forward over a --prompt-len token prompt. Decode: --decode-tokens single-token steps after a
16-token prompt (HF: a greedy loop over its DynamicCache, i.e. HF without generate()'s overhead; moepager:
its real generate path including sampling). Target (issue 2): moepager >= 1.5x HF on decode, >= 1.0x on
prefill. A profile of one moepager decode step says where the time goes.

    python benchmarks/decode_cpu.py [--threads 1 2] [--reps 3]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import (
    RESULTS,
    bytes_per_decode_token,
    ensure_model,
    machine_state,
    median_time,
    print_table,
    write_json,
)
from moepager.models.attention import ForwardBatch
from moepager.runtime.llm import LLM
from moepager.runtime.sampling import SamplingParams


def hf_prefill(hf, ids):
    with torch.inference_mode():
        hf(ids, use_cache=True)


def hf_decode(hf, prompt, steps):
    """Decode tokens/s of HF's greedy loop over its DynamicCache on its device (on CUDA timed between two
    synchronizations, with no sync per token: generous to it)."""
    from transformers import DynamicCache

    sync = torch.cuda.synchronize if hf.device.type == "cuda" else lambda: None
    with torch.inference_mode():
        cache = DynamicCache(config=hf.config)
        out = hf(prompt.to(hf.device), past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        sync()
        t0 = __import__("time").perf_counter()
        for _ in range(steps):
            out = hf(nxt, past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        sync()
        return steps / (__import__("time").perf_counter() - t0)


def ours_prefill(llm, ids):
    model = llm.loaded.model
    cache = model.make_cache(1, ids.shape[1], llm.loaded.dtype, llm.loaded.device)
    with torch.inference_mode():
        model(ids, ForwardBatch.build(torch.arange(ids.shape[1])[None]), cache,
              logits_at_B=torch.tensor([ids.shape[1] - 1]))


def ours_decode(llm, prompt, steps):
    llm.generate([prompt[0].tolist()], SamplingParams(max_tokens=steps + 1, ignore_eos=True))
    return llm.last_stats.decode_tokens_per_s


def gemv_bandwidth(nbytes: int = 256 << 20) -> float:
    """Bytes/s of a bf16 matrix-vector product over a matrix too large for the caches (the decode roofline)."""
    w = torch.randn(nbytes // 2 // 4096, 4096).to(torch.bfloat16)
    x = torch.randn(1, 4096).to(torch.bfloat16)
    return nbytes / median_time(lambda: torch.nn.functional.linear(x, w), 7)


def profile_decode(llm, prompt) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate([prompt[0].tolist()], SamplingParams(max_tokens=9, ignore_eos=True))
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:10]
    total = sum(e.self_cpu_time_total for e in prof.key_averages())
    return [{"op": e.key, "self_cpu_ms": e.self_cpu_time_total / 1e3, "share": e.self_cpu_time_total / total,
             "calls": e.count} for e in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    state = machine_state()
    path = ensure_model(f"olmoe-1b-7b-L{args.layers}", "olmoe-1b-7b", args.layers)
    print(f"model: {path}")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    llm = LLM(path)
    gen = torch.Generator().manual_seed(0)
    vocab = llm.loaded.config.vocab_size
    long_ids = torch.randint(0, vocab, (1, args.prompt_len), generator=gen)
    short_ids = torch.randint(0, vocab, (1, 16), generator=gen)
    rows, results = [], []
    for threads in args.threads:
        torch.set_num_threads(threads)
        hf_prefill(hf, long_ids[:, :32]), ours_prefill(llm, long_ids[:, :32])  # warm-up
        r = {"threads": threads}
        r["hf_prefill_tok_s"] = args.prompt_len / median_time(lambda: hf_prefill(hf, long_ids), args.reps)
        r["ours_prefill_tok_s"] = args.prompt_len / median_time(lambda: ours_prefill(llm, long_ids), args.reps)
        hf_dec, ours_dec = [], []
        for _ in range(args.reps):
            hf_dec.append(hf_decode(hf, short_ids, args.decode_tokens))
            ours_dec.append(ours_decode(llm, short_ids, args.decode_tokens))
        r["hf_decode_tok_s"] = sorted(hf_dec)[len(hf_dec) // 2]
        r["ours_decode_tok_s"] = sorted(ours_dec)[len(ours_dec) // 2]
        r["gemv_GBps"] = gemv_bandwidth() / 1e9
        r["roofline_decode_tok_s"] = r["gemv_GBps"] * 1e9 / bytes_per_decode_token(llm)
        r["prefill_ratio"] = r["ours_prefill_tok_s"] / r["hf_prefill_tok_s"]
        r["decode_ratio"] = r["ours_decode_tok_s"] / r["hf_decode_tok_s"]
        results.append(r)
        rows.append([threads, r["hf_prefill_tok_s"], r["ours_prefill_tok_s"], r["prefill_ratio"],
                     r["hf_decode_tok_s"], r["ours_decode_tok_s"], r["decode_ratio"], r["gemv_GBps"],
                     r["roofline_decode_tok_s"]])
    print_table(["threads", "HF prefill tok/s", "ours prefill tok/s", "ratio", "HF decode tok/s",
                 "ours decode tok/s", "ratio", "GEMV GB/s", "decode roofline tok/s"], rows)
    print(f"weight bytes read per decode token: {bytes_per_decode_token(llm) / 2**20:.0f} MiB")
    torch.set_num_threads(max(args.threads))
    prof = profile_decode(llm, short_ids)
    print("\nmoepager decode profile (8 steps), top ops by self CPU time:")
    print_table(["op", "self ms", "share", "calls"],
                [[p["op"], p["self_cpu_ms"], p["share"], p["calls"]] for p in prof])
    out = write_json("decode_cpu", {"machine": state, "model": str(path), "prompt_len": args.prompt_len,
                                    "bytes_per_decode_token": bytes_per_decode_token(llm),
                                    "decode_tokens": args.decode_tokens, "results": results, "profile": prof})
    _plot(results)
    print(f"\nwrote {out}")


def _plot(results) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install -e '.[bench]')")
        return
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, kind in zip(axes, ("prefill", "decode")):
        xs = range(len(results))
        ax.bar([x - 0.2 for x in xs], [r[f"hf_{kind}_tok_s"] for r in results], 0.4, label="transformers")
        ax.bar([x + 0.2 for x in xs], [r[f"ours_{kind}_tok_s"] for r in results], 0.4, label="moepager")
        ax.set_xticks(list(xs), [f"{r['threads']} thr" for r in results])
        ax.set_title(f"{kind} tokens/s")
        ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "decode_cpu.png", dpi=120)


if __name__ == "__main__":
    main()
