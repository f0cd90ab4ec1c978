"""moepager against its peers on the CPU, all experts resident, bf16: decode tokens/s side by side in one run.

Engines, each measured in interleaved rounds (median of per-token times over --decode steps after a 16-token
prompt): moepager (one row per --kernels entry, to compare the executor's candidates), HF transformers (a
greedy loop over its DynamicCache: transformers without generate()'s overhead) and llama.cpp BF16 through
`llama-cpp-python` when it is installed (`pip install -e ".[peers]"`, which builds llama.cpp from source; on this
project's CPU set CMAKE_ARGS as FACTS.md says, AMX off); the GGUF is converted with the
`convert_hf_to_gguf.py` its source tree vendors, found through --llama-convert). Models: the built-in demo-moe
and `make-model --preset qwen3-30b-a3b --layers 4` (~1.08 GB of weights read per token). Reports tok/s, the
ratios to HF and llama.cpp, and the weight bytes per token divided by the time per token (achieved GB/s).

    python benchmarks/peers.py [--models demo qwen3-30b-a3b] [--threads 1 2] [--rounds 3] [--decode 64]
        [--kernels auto loop gather grouped] [--llama-convert PATH/convert_hf_to_gguf.py]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, bytes_per_decode_token, ensure_model, machine_state, print_table, write_json  # noqa: E402

from moepager.config import EngineConfig  # noqa: E402
from moepager.models.default import default_model_path  # noqa: E402
from moepager.runtime.llm import LLM  # noqa: E402
from moepager.runtime.sampling import SamplingParams  # noqa: E402

PROMPT = 16


class Ours:
    def __init__(self, path: Path, kernel: str):
        self.llm = LLM(config=EngineConfig(model=str(path), expert_kernel=kernel), show_progress=False)

    def tpot(self, ids: list[int], steps: int) -> list[float]:
        self.llm.generate([ids], SamplingParams(max_tokens=steps + 1, ignore_eos=True))
        return list(self.llm.last_stats.tpot_s)


class HF:
    def __init__(self, path: Path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()

    def tpot(self, ids: list[int], steps: int) -> list[float]:
        from transformers import DynamicCache

        times = []
        with torch.inference_mode():
            cache = DynamicCache(config=self.model.config)
            out = self.model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
            for _ in range(steps):
                start = time.perf_counter()
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                out = self.model(nxt, past_key_values=cache, use_cache=True)
                times.append(time.perf_counter() - start)
        return times


class LlamaCpp:
    def __init__(self, path: Path, convert: Path | None, threads: int):
        import llama_cpp

        gguf = RESULTS / "gguf" / f"{path.name}-bf16.gguf"
        if not gguf.exists():
            if convert is None:
                raise RuntimeError("no GGUF yet: pass --llama-convert PATH/convert_hf_to_gguf.py")
            gguf.parent.mkdir(parents=True, exist_ok=True)
            tree = convert.parent  # llama.cpp's tree: the converter imports its conversion/ and gguf-py/
            driver = ("import sys; sys.path[:0] = [sys.argv[1], sys.argv[1] + '/gguf-py']; sys.argv = sys.argv[1:]; "
                      "import runpy, conversion.base as b; "
                      # our BPE tokenizers are byte-level GPT-2 style; the converter only knows hashed presets
                      "b.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'; "
                      "runpy.run_path(sys.argv[0] + '/convert_hf_to_gguf.py', run_name='__main__')")
            subprocess.run([sys.executable, "-c", driver, str(tree), str(path), "--outtype", "bf16",
                            "--outfile", str(gguf)], check=True)
        self.model = llama_cpp.Llama(str(gguf), n_ctx=PROMPT + 512, n_threads=threads, verbose=False)
        self.threads = threads

    def tpot(self, ids: list[int], steps: int) -> list[float]:
        self.model.reset()
        self.model.eval(ids)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            token = int(self.model.scores[self.model.n_tokens - 1].argmax())
            self.model.eval([token])
            times.append(time.perf_counter() - start)
        return times


def model_path(name: str) -> Path:
    return default_model_path() if name == "demo" else ensure_model(f"{name}-L4", name, 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["demo", "qwen3-30b-a3b"])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--kernels", nargs="+", default=["auto"], help="moepager expert kernels to run (one row each)")
    ap.add_argument("--llama-convert", type=Path, help="llama.cpp's convert_hf_to_gguf.py (to make the GGUF once)")
    args = ap.parse_args()
    state = machine_state()
    have_llama = importlib.util.find_spec("llama_cpp") is not None
    if not have_llama:
        print("llama.cpp: not measured (llama-cpp-python is not installed: pip install -e \".[peers]\")")
    results, rows = [], []
    for name in args.models:
        path = model_path(name)
        ours = {f"moepager {k}": Ours(path, k) for k in args.kernels}
        peers = {"HF": HF(path)}
        first = next(iter(ours.values())).llm
        nbytes, vocab = bytes_per_decode_token(first), first.loaded.config.vocab_size
        ids = torch.randint(0, vocab, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
        for threads in args.threads:
            torch.set_num_threads(threads)
            engines = {**ours, **peers}
            if have_llama:
                try:
                    engines["llama.cpp BF16"] = LlamaCpp(path, args.llama_convert, threads)
                except Exception as e:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
                    print(f"llama.cpp on {name}: not measured ({e})")
            for engine in engines.values():
                engine.tpot(ids, 4)  # warm-up
            times: dict[str, list[float]] = {k: [] for k in engines}
            for _ in range(args.rounds):
                for label, engine in engines.items():
                    times[label] += engine.tpot(ids, args.decode)
            tok_s = {label: 1 / statistics.median(t) for label, t in times.items()}
            r = {"model": name, "threads": threads, "bytes_per_token": nbytes, "tok_s": tok_s,
                 "GBps": {label: v * nbytes / 1e9 for label, v in tok_s.items()}}
            results.append(r)
            for label, v in tok_s.items():
                rows.append([name, threads, label, v, v / tok_s["HF"],
                             v / tok_s["llama.cpp BF16"] if "llama.cpp BF16" in tok_s else "-", v * nbytes / 1e9])
    print_table(["model", "threads", "engine", "decode tok/s", "x HF", "x llama.cpp BF16", "GB/s of weights"], rows)
    out = write_json("peers", {"machine": state, "decode_steps": args.decode, "rounds": args.rounds,
                               "results": results})
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
