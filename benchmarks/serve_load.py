"""Load on the server and on the engine's continuous batching: does batching pay?

Part 1, HTTP: `moepager serve` with the built-in model (a subprocess, --threads 2) all resident and at a 25%
expert budget; N concurrent streaming clients share a fixed number of requests (prompts from the demo model's
validation documents, 32 tokens each, llama.cpp's default sampling), once with a light client that reads the
event stream itself and once with the official `openai` async client (`CLIENTS`). Reported per run: output
throughput, TTFT and TPOT p50/p99, errors, and expert bytes moved per output token (from the server's /metrics).
Issue 17's targets: 8 clients >= 3x one client's output throughput (resident), and fewer expert bytes per output
token batched than alone at 25%.

Part 2, real routing: HTTP requests route with the model's own router (random weights on real geometries:
nearly static), so the paged real-geometry figure comes from replayed routing instead. A DeepSeek-V2-Lite
geometry checkpoint (8 MoE layers, 64 experts, top-6) at a 25% budget replays requests of the DeepSeek-V2-Lite
trace through the engine one at a time and 8 at a time (continuous batching, LLM.replay(concurrency=8)).

Client and server share this machine's 2 cores; the client's share is part of what is measured (hence the
light client beside the official one).

    python benchmarks/serve_load.py [--requests 32] [--tokens 32] [--clients 1 8] [--client raw openai]
                                    [--repeat 1] [--skip-replay] [--compile]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai

from benchmarks.common import demo_documents, ensure_model, machine_state, print_table, write_json
from moepager.runtime.stats import percentile

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`moepager serve` as a subprocess, stopped on exit."""

    def __init__(self, extra: list[str], threads: int):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "moepager.cli.main", "serve", "--port", str(self.port), "--threads",
               str(threads), "--served-model-name", SERVED, "--quiet", *extra]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def __enter__(self) -> Server:
        deadline = time.monotonic() + 600  # --compile compiles while it loads: minutes on a cold cache
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited: {self.proc.stderr.read() if self.proc.stderr else ''}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.2)
        raise SystemExit("the server did not start within 600 s")

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)

    def counters(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics").text

        def value(pattern: str) -> float:
            m = re.search(pattern + r" ([0-9.e+-]+)$", text, re.M)
            return float(m.group(1)) if m else 0.0
        return {"tokens": value(r"^moepager_generation_tokens_total"),
                "steps": value(r"^moepager_step_seconds_count"), "step_s": value(r"^moepager_step_seconds_sum"),
                "bytes": value(r'^moepager_expert_bytes_total\{tier="disk"\}')
                + value(r'^moepager_expert_bytes_total\{tier="host_to_device"\}')}


SERVED = "served"
"""The name every server of this script serves its model under."""
SAMPLING: dict[str, float] = {}
"""Extra sampling fields of every request (--greedy: temperature 0; default: the server's llama.cpp defaults)."""


async def openai_texts(client: openai.AsyncOpenAI, url: str, prompt: str, tokens: int) -> AsyncIterator[str]:
    """One streaming completion's text pieces, through the official client."""
    stream = await client.completions.create(model=SERVED, prompt=prompt, max_tokens=tokens, stream=True,
                                             extra_body={"ignore_eos": True, **SAMPLING})
    async for chunk in stream:
        if chunk.choices:
            yield chunk.choices[0].text


async def raw_texts(client: httpx.AsyncClient, url: str, prompt: str, tokens: int) -> AsyncIterator[str]:
    """The same, with the server-sent events read off the wire (as vLLM's benchmark_serving reads them): one
    `json.loads` per event instead of the `openai` client's typed objects."""
    body = {"model": SERVED, "prompt": prompt, "max_tokens": tokens, "stream": True, "ignore_eos": True,
            **SAMPLING}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[6:]).get("choices")
                if choices:
                    yield choices[0]["text"]


async def timed(texts: AsyncIterator[str], tokens: int) -> dict[str, float]:
    """TTFT and TPOT of one request, from the arrival of its non-empty text pieces (the request is sent when
    the iteration starts)."""
    start = time.perf_counter()
    first = last = None
    async for text in texts:
        if text:
            last = time.perf_counter()
            first = first or last
    assert first is not None and last is not None
    return {"ttft_s": first - start, "tpot_s": (last - first) / max(1, tokens - 1)}


CLIENTS = ("raw", "openai")
"""Load generators: `raw` parses the event stream itself (a light client, so the server's share of the 2 cores
is what the figure measures); `openai` is the official client, whose per-event parsing costs ~3x the server's
per-event work (0.27 against 0.09 ms of CPU, per-thread CPU time from /proc during an 8-client run) and runs on
the same 2 cores."""


async def load(url: str, prompts: list[str], clients: int, tokens: int, kind: str = "raw") -> dict[str, object]:
    client = (openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=600, max_retries=0)
              if kind == "openai" else httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients)))
    texts = openai_texts if kind == "openai" else raw_texts
    queue = list(prompts)
    results: list[dict[str, float]] = []
    errors: list[str] = []

    async def worker() -> None:
        while queue:
            prompt = queue.pop()
            try:
                results.append(await timed(texts(client, url, prompt, tokens), tokens))  # type: ignore[arg-type]
            except Exception as e:  # noqa: BLE001 - counted, reported
                errors.append(repr(e))
    async with client:
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - start
    ttft, tpot = [r["ttft_s"] for r in results], [r["tpot_s"] for r in results]
    return {"client": kind, "clients": clients, "requests": len(prompts), "wall_s": wall, "errors": len(errors),
            "error_samples": errors[:3], "output_tok_s": len(results) * tokens / wall,
            "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
            "tpot_p50_ms": 1e3 * percentile(tpot, 50), "tpot_p99_ms": 1e3 * percentile(tpot, 99)}


def http_part(args: argparse.Namespace) -> list[dict[str, object]]:
    _, validation = demo_documents()
    prompts = [" ".join(doc.split()[:24]) for doc in validation if len(doc.split()) >= 8][: args.requests]
    if len(prompts) < args.requests:
        prompts = (prompts * args.requests)[: args.requests]
    runs = [("all resident", [], prompts, args.clients, args.tokens),
            ("25% budget", ["--expert-memory", "25%", "--policy", args.policy], prompts, args.clients, args.tokens)]
    if args.compile:  # the same servers with the compiled decode step, batched passes included
        runs += [(f"{label}, --compile", [*extra, "--compile"], *rest) for label, extra, *rest in runs]
    if args.scheduling:  # ExpertFlow's token scheduler against FIFO at the same step size, each client count
        budget = ["--expert-memory", "25%", "--policy", args.policy]
        runs = [] if args.scheduling_only else runs
        for clients in args.clients:
            half = str(max(1, clients // 2))
            runs += [(f"25%, fifo, {half} a step", [*budget, "--max-num-seqs", half], prompts, [clients], args.tokens),
                     (f"25%, expertflow, {half} a step", [*budget, "--max-num-seqs", half, "--batch-policy",
                                                          "expertflow"], prompts, [clients], args.tokens)]
    if args.real_geometry:
        model = str(ensure_model("qwen3-30b-a3b-L4", "qwen3-30b-a3b", 4))
        runs.append(("qwen3-30b-a3b L4, 25%", ["--model", model, "--expert-memory", "25%", "--policy", args.policy],
                     prompts[: args.real_requests], [1, 4], args.real_tokens))
    rows = []
    for label, extra, chosen, clients_list, tokens in runs:
        with Server(extra, args.threads) as server:
            for clients in clients_list:  # warm-up at every batch size: first-call set-up is not load
                asyncio.run(load(server.url, chosen[:clients], clients, 4))
            plan = [(kind, clients) for _ in range(args.repeat) for kind in args.client for clients in clients_list]
            for kind, clients in plan:
                before = server.counters()
                row = asyncio.run(load(server.url, chosen, clients, tokens, kind))
                after = server.counters()
                moved = after["bytes"] - before["bytes"]
                steps = max(1.0, after["steps"] - before["steps"])
                row |= {"config": label, "tokens": tokens,
                        "expert_bytes_per_output_token": moved / max(1.0, after["tokens"] - before["tokens"]),
                        "engine_steps": steps, "step_ms_mean": 1e3 * (after["step_s"] - before["step_s"]) / steps,
                        "engine_busy": (after["step_s"] - before["step_s"]) / row["wall_s"]}
                rows.append(row)
                print(f"{label}, {kind} client, {clients} clients: {row['output_tok_s']:.1f} tok/s, "
                      f"{row['errors']} errors")
    return rows


def replay_part(args: argparse.Namespace) -> list[dict[str, object]]:
    from benchmarks.offload_replay import deepseek_trace, replayed_requests
    from moepager.config import EngineConfig, StoreConfig
    from moepager.runtime.llm import LLM
    from moepager.runtime.replay import ReplaySpec

    model = ensure_model("deepseek-v2-lite-L9", "deepseek-v2-lite", 9)
    trace = deepseek_trace(8)
    requests = replayed_requests(trace, 0, args.replay_requests, args.replay_prompt + args.replay_decode)
    spec = ReplaySpec(trace, requests, args.replay_prompt, "match", args.replay_decode)
    rows = []
    for concurrency in (1, 8):
        llm = LLM(config=EngineConfig(model=str(model), threads=args.threads,
                                      store=StoreConfig(expert_memory="25%", policy=args.policy)),
                  show_progress=False)
        start = time.perf_counter()
        out = llm.replay(spec, concurrency=concurrency)
        wall = time.perf_counter() - start
        stats = llm.last_stats
        decode = stats.sections["experts"].phases["decode"]
        generated = sum(len(c.token_ids) for c in out)
        phases = stats.sections["experts"].phases.values()
        total_bytes = sum(p["bytes_disk"] + p["bytes_host_to_device"] for p in phases)
        rows.append({"concurrency": concurrency, "requests": len(requests), "output_tok_s": generated / wall,
                     "tpot_median_ms": 1e3 * stats.tpot_median_s, "decode_hit_rate": decode["hit_rate"],
                     "expert_bytes_per_output_token": total_bytes / generated,
                     "decode_bytes_disk_per_token": decode["bytes_disk_per_token"]})
        print(f"replay at 25%, {concurrency} at a time: {rows[-1]['output_tok_s']:.2f} tok/s")
    return rows


def http_report(http: list[dict[str, object]], repeat: int) -> dict[str, dict[str, float]]:
    """Print the HTTP runs and, per (config, client), the most clients' ratios to one client's medians."""
    print()
    print_table(["config", "client", "clients", "out tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
                 "TPOT p99 ms", "errors", "expert B/out tok", "step ms", "engine busy"],
                [[r["config"], r["client"], r["clients"], r["output_tok_s"], r["ttft_p50_ms"], r["ttft_p99_ms"],
                  r["tpot_p50_ms"], r["tpot_p99_ms"], r["errors"],
                  f"{r['expert_bytes_per_output_token'] / 2**20:.2f} MiB", r["step_ms_mean"],
                  f"{100 * r['engine_busy']:.0f}%"] for r in http])
    ratios = {}
    for label, kind in dict.fromkeys((r["config"], r["client"]) for r in http):
        runs = [r for r in http if (r["config"], r["client"]) == (label, kind)]
        by = {n: {key: statistics.median(r[key] for r in runs if r["clients"] == n)
                  for key in ("output_tok_s", "expert_bytes_per_output_token")} for n in {r["clients"] for r in runs}}
        if 1 in by and len(by) > 1:
            most = max(by)
            ratios[f"{label}, {kind} client"] = ratio = {
                "clients": most, "runs": repeat,
                "throughput_ratio": by[most]["output_tok_s"] / by[1]["output_tok_s"],
                "bytes_per_token_ratio": by[most]["expert_bytes_per_output_token"]
                / max(1.0, by[1]["expert_bytes_per_output_token"])}
            print(f"{label}, {kind} client: {most} clients / 1 client (medians of {repeat}): throughput "
                  f"{ratio['throughput_ratio']:.2f}x, "
                  f"expert bytes per output token {ratio['bytes_per_token_ratio']:.2f}x")
    return ratios


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--client", nargs="+", choices=CLIENTS, default=list(CLIENTS),
                   help="load generators, each run against every server (default: both, side by side)")
    p.add_argument("--repeat", type=int, default=1,
                   help="run every (client, clients) pair this many times, interleaved; ratios from the medians")
    p.add_argument("--skip-replay", action="store_true")
    p.add_argument("--scheduling", action="store_true",
                   help="also, at 25%%, servers that take half of each --clients count a step: FIFO and --batch-policy "
                        "expertflow (ExpertFlow's token scheduler)")
    p.add_argument("--scheduling-only", action="store_true", help="--scheduling's servers only")
    p.add_argument("--real-geometry", action="store_true",
                   help="also serve a qwen3-30b-a3b-geometry checkpoint (4 layers) at 25%% to 1 and 4 clients (its "
                        "random-weight routing is nearly static: a serving check, not an offloading figure)")
    p.add_argument("--real-requests", type=int, default=8)
    p.add_argument("--compile", action="store_true",
                   help="also each built-in-model server with --compile (batched decode passes compiled too)")
    p.add_argument("--out", help="name of the JSON under benchmarks/results/ (default serve_load[_POLICY])")
    p.add_argument("--real-tokens", type=int, default=8)
    p.add_argument("--greedy", action="store_true", help="temperature 0 instead of llama.cpp's sampling")
    p.add_argument("--policy", default="lru", help="eviction policy of the 25%% runs (default lru)")
    p.add_argument("--replay-requests", type=int, default=8)
    p.add_argument("--replay-prompt", type=int, default=16)
    p.add_argument("--replay-decode", type=int, default=16)
    args = p.parse_args()
    if args.greedy:
        SAMPLING["temperature"] = 0.0
    state = machine_state()
    http = http_part(args)
    ratios = http_report(http, args.repeat)
    replay = [] if args.skip_replay else replay_part(args)
    if replay:
        print()
        print_table(["at a time", "requests", "out tok/s", "TPOT median ms", "decode hit rate", "expert B/out tok"],
                    [[r["concurrency"], r["requests"], r["output_tok_s"], r["tpot_median_ms"],
                      f"{100 * r['decode_hit_rate']:.1f}%", f"{r['expert_bytes_per_output_token'] / 2**20:.1f} MiB"]
                     for r in replay])
        a, b = replay
        print(f"replayed DeepSeek-V2-Lite routing at 25%: 8 at a time / 1: throughput "
              f"{b['output_tok_s'] / a['output_tok_s']:.2f}x, expert bytes per output token "
              f"{b['expert_bytes_per_output_token'] / a['expert_bytes_per_output_token']:.2f}x")
    name = args.out or ("serve_load" if args.policy == "lru" else f"serve_load_{args.policy}")
    path = write_json(name, {"machine": state, "args": vars(args), "http": http, "ratios": ratios, "replay": replay})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
