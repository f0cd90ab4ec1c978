"""`moepager trace convert|info|stats`: turn public routing traces into trace format v1, describe a trace file,
and summarise its routing (expert-use skew and token-to-token locality per layer)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from typing import Any

import numpy as np
from tqdm import tqdm

from moepager.atomic_io import atomic_file, check_file
from moepager.store.budget import format_bytes
from moepager.trace.convert import CONVERTERS, ConvertOptions, convert
from moepager.trace.format import DECODE, MISSING, TraceError, TraceReader
from moepager.trace.stats import format_stats, routing_stats

HELP = "convert public routing traces to moepager's trace format, or describe a trace file"


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="trace_command", required=True, parser_class=type(p))
    c = sub.add_parser("convert", help="convert a trace", description="convert SRC (file or folder) to DST")
    c.add_argument("--format", required=True, choices=sorted(CONVERTERS), help="the source format")
    c.add_argument("src", help="source file or folder (searched recursively)")
    c.add_argument("dst", help="trace file to write (e.g. traces/deepseek.mpt)")
    c.add_argument("--force", action="store_true", help="replace an existing DST file")
    c.add_argument("--model", help="model name for the header (default: the published set's model)")
    c.add_argument("--num-experts", type=int, help="experts per layer (default: known or largest id + 1)")
    c.add_argument("--top-k", type=int, help="top-k (olmoe-counts: inferred from a sibling *_top1 folder)")
    c.add_argument("--expert-bytes", type=int, help="bytes of one expert as served (cost model)")
    c.add_argument("--layers", help="olmoe-counts: decoder-layer index of each counter, e.g. 0,7,15")
    i = sub.add_parser("info", help="describe a trace file", description="header, requests, tokens and priors")
    i.add_argument("path", help="trace file")
    s = sub.add_parser("stats", help="per-layer expert-use entropy and same-expert-as-previous-token rate",
                       description="how skewed and how local a trace's routing is, per MoE layer")
    s.add_argument("path", help="trace file")
    s.add_argument("--json", metavar="PATH", help="also write the statistics as JSON")
    s.add_argument("--force", action="store_true", help="replace an existing --json file")


def _progress(items: Iterable[Any], total: int) -> Iterable[Any]:
    return tqdm(items, total=total, unit="file", desc="converting", leave=False)


def run(args: argparse.Namespace) -> int:
    if args.trace_command == "info":
        return _info(args.path)
    if args.trace_command == "stats":
        json_out = check_file(args.json, "--json", args.force, {"PATH": args.path})
        with TraceReader(args.path) as reader:
            total = len(reader)
        with tqdm(total=total, unit="request", desc="reading", leave=False) as bar:
            stats = routing_stats(args.path, bar.update)
        print(format_stats(stats))
        if json_out is not None:
            with atomic_file(json_out) as tmp:
                tmp.write_text(json.dumps(stats.to_json(), indent=2))
        return 0
    try:
        layers = tuple(int(x) for x in args.layers.split(",")) if args.layers else None
    except ValueError:
        raise TraceError(f"--layers takes comma-separated layer indices (e.g. 0,7,15), got '{args.layers}'") from None
    opts = ConvertOptions(model=args.model, num_experts=args.num_experts, top_k=args.top_k,
                          expert_bytes=args.expert_bytes, layers=layers)
    summary = convert(args.format, args.src, args.dst, opts, _progress, replace=args.force)
    dropped = f", {summary.missing_entries} expert entries missing in the source" if summary.missing_entries else ""
    priors = f", {summary.priors} priors" if summary.priors else ""
    print(f"wrote {args.dst}: {summary.requests} requests, {summary.tokens} tokens{dropped}{priors}")
    return 0


def _info(path: str) -> int:
    with TraceReader(path) as reader:
        h = reader.header
        tokens = decode = missing = 0
        for request in tqdm(reader, total=len(reader), unit="request", desc="reading", leave=False):
            tokens += request.num_tokens
            decode += int((request.phase_T == DECODE).sum())
            missing += int((request.ids_TLK == MISSING).sum())
        rows = [("model", h.model), ("source", h.source), ("schema", str(h.schema_version)),
                ("MoE layers", f"{h.num_layers} ({h.moe_layers[0]}..{h.moe_layers[-1]})"),
                ("experts", f"{h.num_experts} routed, top-{h.top_k}, {h.num_shared} shared"),
                ("bytes per expert", format_bytes(h.expert_bytes) if h.expert_bytes else "unknown"),
                ("requests", str(len(reader))),
                ("tokens", f"{tokens} ({decode} recorded as decode, {tokens - decode} as prefill)"),
                ("missing entries", f"{missing} ({missing / max(tokens * h.num_layers * h.top_k, 1):.2%})"),
                ("priors", ", ".join(f"{n} ({int(np.sum(reader.prior(n)))} activations)" for n in reader.prior_names)
                 or "none")]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0
