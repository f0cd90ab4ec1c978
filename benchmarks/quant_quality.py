"""How much quantized experts change a model: perplexity and next-token agreement on the built-in model's
validation text, and every MoE layer's relative output error on it and on a real-geometry checkpoint.

Built-in model (trained, real text): every validation document's first --tokens tokens (scripts/
train_demo_model.py's split), one prefill each batch; perplexity of each format and the fraction of positions
whose top-1 next token equals the bf16 run's. Targets (issue 16): int8 perplexity <= +1% and agreement >= 99%;
int4 <= +5% and >= 95%. `int8, packed kernel` is `--expert-kernel packed` on int8 experts: FBGEMM with the
activations quantized to 8 bits per token as well (experts/quant.py's int8_packed_mm).

Per-layer error: each MoE block's output in the quantized run divided by the bf16 block's, on the bf16 run's
own inputs to that block (so errors do not accumulate from earlier layers): ||y_q - y|| / ||y||. The row
`fp32 (whole model)` runs every weight in fp32: how far bf16's own rounding moves the same measures (a floor for
what any format can agree with bf16); the rows `experts rounded to 10/12 bits (simulated)` show how the agreement
saturates as the experts' weight error shrinks below int8's. The real
geometry is `make-model --preset qwen3-30b-a3b --layers 4` (random weights: their distribution is Gaussian,
real weights have heavier tails, which favours zero points and small groups more than this shows).

    python benchmarks/quant_quality.py [--tokens 256] [--docs 0 (all)] [--real qwen3-30b-a3b]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import demo_documents, ensure_model, machine_state, print_table, write_json
from moepager.checkpoints.default import default_model_path
from moepager.loading.build import resident_executor
from moepager.models.attention import ForwardBatch
from moepager.models.moe import MoEBlock
from moepager.runtime.builder import load_model
from moepager.runtime.tokenizer import Tokenizer

FORMATS = {  # name -> load_model options
    "bf16": {},
    "fp32 (whole model)": dict(dtype=torch.float32),  # the reference's own rounding noise, for scale
    "int8": dict(expert_dtype="int8"),
    "int8, packed kernel": dict(expert_dtype="int8", executor_factory=resident_executor(torch.device("cpu"), "packed")),
    "int8 + dense int8": dict(expert_dtype="int8", dense_dtype="int8"),
    "int8 packed + dense int8-a8": dict(expert_dtype="int8", dense_dtype="int8-a8",
                                        executor_factory=resident_executor(torch.device("cpu"), "packed")),
    "int4 g32": dict(expert_dtype="int4", int4_group=32),
    "int4 g32 zp": dict(expert_dtype="int4", int4_group=32, int4_zero_point=True),
    "int4 g64": dict(expert_dtype="int4", int4_group=64),
    "int4 g64 zp": dict(expert_dtype="int4", int4_group=64, int4_zero_point=True),
}
REAL_FORMATS = ["bf16", "int8", "int8, packed kernel", "int4 g32", "int4 g32 zp", "int4 g64 zp"]
SIMULATED_BITS = (10, 12)
"""Rows `experts rounded to N bits (simulated)`: the bf16 experts rounded in place to N-bit per-output-channel levels
(int8's scheme with more levels, kept in bf16): how close to bf16 a weight error smaller than int8's can get, i.e.
where the agreement measure saturates on this model."""
BATCH = 16


def moe_blocks(loaded) -> list[MoEBlock]:
    return [m for m in loaded.model.modules() if isinstance(m, MoEBlock)]


def forward_logits(loaded, docs: list[list[int]], capture: list[list[torch.Tensor]] | None = None) -> torch.Tensor:
    """Logits [docs, T, V] in fp32 (one prefill per batch of equal-length documents); with `capture`, every MoE
    block's input rows are appended there, batch by batch."""
    hooks = []
    if capture is not None:
        for i, block in enumerate(moe_blocks(loaded)):
            hooks.append(block.register_forward_hook(lambda m, args, out, i=i: capture[i].append(args[0].detach())))
    out = []
    with torch.inference_mode():
        for s in range(0, len(docs), BATCH):
            ids = torch.tensor(docs[s: s + BATCH])
            b, t = ids.shape
            cache = loaded.model.make_cache(b, t, loaded.dtype, loaded.device)
            out.append(loaded.model(ids, ForwardBatch.build(torch.arange(t).expand(b, t)), cache).float())
    for h in hooks:
        h.remove()
    return torch.cat(out)


def layer_errors(loaded, inputs: list[list[torch.Tensor]], ref_blocks: list[MoEBlock]) -> list[float]:
    """Every MoE block's ||y_q - y|| / ||y|| on the reference run's inputs to it."""
    errs = []
    with torch.inference_mode():
        for block, ref, xs in zip(moe_blocks(loaded), ref_blocks, inputs):
            num = den = 0.0
            for x in xs:
                y, yq = ref(x).float(), block(x.to(block.gate.weight.dtype)).float()
                num += float((yq - y).pow(2).sum())
                den += float(y.pow(2).sum())
            errs.append(math.sqrt(num / den))
    return errs


def rounded_experts(path: Path, bits: int):
    """The bf16 model with every expert weight rounded to `bits`-bit symmetric per-output-channel levels."""
    loaded = load_model(path, show_progress=False)
    kernels, top = loaded.experts.kernels, 2 ** (bits - 1) - 1
    with torch.no_grad():
        for w in (kernels.gate_up_R2FD, kernels.down_RDF):  # views of the resident arena
            w32 = w.float()
            scale = w32.abs().amax(-1, keepdim=True).clamp(min=1e-12) / top
            w.copy_(torch.round(w32 / scale).clamp(-top, top) * scale)
    return loaded


def demo_quality(tokens: int, max_docs: int) -> list[dict]:
    path = default_model_path()
    tok = Tokenizer(path)
    _, validation = demo_documents()
    docs = [ids[:tokens] for ids in (tok.encode(d) for d in validation) if len(ids) >= tokens]
    docs = docs[:max_docs] if max_docs else docs
    print(f"demo-moe: {len(docs)} validation documents x {tokens} tokens")
    ref = load_model(path, show_progress=False)
    inputs: list[list[torch.Tensor]] = [[] for _ in moe_blocks(ref)]
    ref_logits = forward_logits(ref, docs, inputs)
    targets = torch.tensor(docs)[:, 1:]
    ref_top1 = ref_logits[:, :-1].argmax(-1)
    rows = []
    runs = {name: lambda opts=opts: load_model(path, show_progress=False, **opts) for name, opts in FORMATS.items()}
    for b in SIMULATED_BITS:
        runs[f"experts rounded to {b} bits (simulated)"] = lambda b=b: rounded_experts(path, b)
    for name, make in runs.items():
        loaded = ref if name == "bf16" else make()
        logits = ref_logits if name == "bf16" else forward_logits(loaded, docs)
        nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1)).item()
        agree = (logits[:, :-1].argmax(-1) == ref_top1).float().mean().item()
        errs = layer_errors(loaded, inputs, moe_blocks(ref))
        rows.append({"format": name, "perplexity": math.exp(nll), "top1_agreement": agree, "layer_errors": errs,
                     "expert_bytes": loaded.expert_shape.nbytes})
    base = rows[0]["perplexity"]
    for r in rows:
        r["perplexity_change"] = r["perplexity"] / base - 1
    return rows


def real_errors(preset: str, tokens: int) -> list[dict]:
    path = ensure_model(f"{preset}-L4", preset, 4)
    ref = load_model(path, show_progress=False)
    ids = torch.randint(0, ref.config.vocab_size, (2, tokens), generator=torch.Generator().manual_seed(0)).tolist()
    inputs: list[list[torch.Tensor]] = [[] for _ in moe_blocks(ref)]
    forward_logits(ref, ids, inputs)
    rows = []
    for name in REAL_FORMATS[1:]:
        loaded = load_model(path, show_progress=False, **FORMATS[name])
        rows.append({"format": name, "layer_errors": layer_errors(loaded, inputs, moe_blocks(ref)),
                     "expert_bytes": loaded.expert_shape.nbytes, "bf16_expert_bytes": ref.expert_shape.nbytes})
        del loaded
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per validation document")
    ap.add_argument("--docs", type=int, default=0, help="at most this many documents (0: all)")
    ap.add_argument("--real", default="qwen3-30b-a3b", help="real-geometry preset for per-layer errors ('' skips)")
    ap.add_argument("--real-tokens", type=int, default=64)
    args = ap.parse_args()
    machine = machine_state()
    torch.manual_seed(0)
    demo = demo_quality(args.tokens, args.docs)
    print_table(["format", "expert bytes", "perplexity", "vs bf16", "top-1 agreement", "MoE layer rel. error (max)"],
                [[r["format"], r["expert_bytes"], r["perplexity"], f"{r['perplexity_change']:+.2%}",
                  f"{r['top1_agreement']:.2%}", f"{max(r['layer_errors']):.4f}"] for r in demo])
    real = []
    if args.real:
        real = real_errors(args.real, args.real_tokens)
        print(f"\n{args.real} geometry (4 layers, random weights): MoE block relative output error per layer")
        print_table(["format", "bytes vs bf16", *(f"layer {i}" for i in range(len(real[0]["layer_errors"])))],
                    [[r["format"], f"{r['expert_bytes'] / r['bf16_expert_bytes']:.3f}",
                      *(f"{e:.4f}" for e in r["layer_errors"])] for r in real])
    out = write_json("quant_quality", {"machine": machine, "tokens": args.tokens, "demo": demo,
                                       "real_geometry": {"preset": args.real, "rows": real}})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
