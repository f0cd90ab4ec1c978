"""Train moepager's built-in demo model: a small Qwen3-MoE language model on the OLMoE-stats texts.

    python scripts/train_demo_model.py --corpus ../shared/traces/olmoe-stats/text --out moepager/data/demo-moe

Steps: (1) split the corpus files (books left out) into ~2 kB documents and send every 20th to validation;
(2) train a byte-level BPE tokenizer on the training documents; (3) train the model with the language-model
loss plus transformers' load-balancing auxiliary loss (Switch Transformer, Fedus et al. 2021, eq. 4) so all
experts get used; (4) write a standard Hugging Face checkpoint directory in bf16 with a model card.

The run is seeded and resumable: batches are drawn from a generator seeded by (seed, step), and the model,
optimizer and step are saved to `--work-dir` every `--save-every` steps, so `--resume` continues to the same
weights an uninterrupted run would reach. transformers is used for training only; moepager's own model code
runs the result.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from moepager.loading.synth import CHAT_TEMPLATE, SPECIAL_TOKENS

CORPUS_FILES = ["wikipedia_texts.txt", "c4_texts.txt", "arxiv_texts.txt", "github_oss_with_stack_texts.txt"]
DOC_CHARS = 2000
VALID_EVERY = 20
EOS = "<|endoftext|>"
CONTINUATION_PROMPTS = ["The history of", "In this paper, we", "def main():", "The city is located"]


@dataclass(frozen=True)
class Hyper:
    """Everything that shapes the trained weights; written to the model card."""
    vocab_size: int = 8192
    hidden_size: int = 256
    layers: int = 6
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 32
    experts: int = 32
    top_k: int = 4
    expert_ffn: int = 64
    seq_len: int = 256
    batch: int = 16
    steps: int = 1200
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    aux_loss_coef: float = 0.01
    seed: int = 0


def split_documents(corpus: Path) -> tuple[list[str], list[str]]:
    """Whole lines grouped into ~DOC_CHARS documents, file by file; every VALID_EVERY-th is validation (lines, not
    paragraphs: some files have no blank lines, and each domain must be in both splits in proportion)."""
    train: list[str] = []
    valid: list[str] = []
    for name in CORPUS_FILES:
        path = corpus / name
        if not path.exists():
            sys.exit(f"error: {path} not found; --corpus must be the olmoe-stats text directory")
        doc: list[str] = []
        size = 0
        index = 0
        for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
            doc.append(line)
            size += len(line)
            if size >= DOC_CHARS:
                (valid if index % VALID_EVERY == VALID_EVERY - 1 else train).append("".join(doc))
                doc, size, index = [], 0, index + 1
        if doc:
            train.append("".join(doc))
    if not valid:
        sys.exit(f"error: {corpus} is too small: no validation documents (every {VALID_EVERY}th of "
                 f"~{DOC_CHARS}-character documents)")
    return train, valid


def train_tokenizer(docs: list[str], vocab_size: int, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": EOS, "pad_token": EOS,
        "chat_template": CHAT_TEMPLATE, "model_max_length": 4096}, indent=2))


def encode_stream(tokenizer, docs: list[str]) -> torch.Tensor:
    """All documents as one token stream, each followed by <|endoftext|>."""
    eos = tokenizer.token_to_id(EOS)
    ids: list[int] = []
    for enc in tokenizer.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int64)


def model_config(h: Hyper, eos_id: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=h.vocab_size, hidden_size=h.hidden_size, intermediate_size=4 * h.hidden_size,
        moe_intermediate_size=h.expert_ffn, num_hidden_layers=h.layers, num_attention_heads=h.heads,
        num_key_value_heads=h.kv_heads, head_dim=h.head_dim, num_experts=h.experts, num_experts_per_tok=h.top_k,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=4096,
        rms_norm_eps=1e-6, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        tie_word_embeddings=True, output_router_logits=True, router_aux_loss_coef=h.aux_loss_coef,
        bos_token_id=None, eos_token_id=eos_id, pad_token_id=eos_id)


def batch_at(stream: torch.Tensor, h: Hyper, step: int) -> torch.Tensor:
    """The step's batch: `batch` random windows of seq_len + 1 tokens, from a generator seeded by (seed, step)."""
    gen = torch.Generator().manual_seed(h.seed * 1_000_003 + step)
    starts = torch.randint(0, len(stream) - h.seq_len - 1, (h.batch,), generator=gen)
    return torch.stack([stream[s:s + h.seq_len + 1] for s in starts.tolist()])


def lr_at(h: Hyper, step: int) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio * lr."""
    if step < h.warmup:
        return h.lr * (step + 1) / h.warmup
    progress = (step - h.warmup) / max(1, h.steps - h.warmup)
    return h.lr * (h.min_lr_ratio + (1 - h.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model, stream: torch.Tensor, seq_len: int, max_windows: int | None = None) -> float:
    """Mean next-token cross-entropy (nats) over non-overlapping windows of the stream."""
    model.eval()
    n = (len(stream) - 1) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    total = 0.0
    count = 0
    for i in range(0, n, 16):
        rows = [stream[j * seq_len:(j + 1) * seq_len + 1] for j in range(i, min(n, i + 16))]
        x = torch.stack(rows)
        logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten(), reduction="sum")
        total += loss.item()
        count += x[:, 1:].numel()
    model.train()
    return total / count


def unigram_loss(train: torch.Tensor, valid: torch.Tensor, vocab_size: int) -> float:
    """Cross-entropy (nats) of validation tokens under add-one-smoothed training-token frequencies."""
    counts = torch.bincount(train, minlength=vocab_size).double() + 1
    logp = (counts / counts.sum()).log()
    return float(-logp[valid].mean())


def save_state(work: Path, model, opt, step: int, log: list[dict], hyper: dict) -> None:
    tmp = work / "state.pt.partial"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "log": log, "hyper": hyper}, tmp)
    tmp.replace(work / "state.pt")


def greedy_continuations(model, tokenizer, max_new: int = 40) -> list[tuple[str, str]]:
    model.eval()
    out = []
    for prompt in CONTINUATION_PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt).ids])
        gen = model.generate(ids, max_new_tokens=max_new, do_sample=False)
        out.append((prompt, tokenizer.decode(gen[0, ids.shape[1]:].tolist(), skip_special_tokens=True)))
    return out


def write_card(out: Path, h: Hyper, command: str, results: dict, samples: list[tuple[str, str]]) -> None:
    lines = [
        "# moepager demo-moe", "",
        "A small Qwen3-MoE language model trained by `scripts/train_demo_model.py` so that moepager's default",
        "model produces real text and real routing. It is a toy: it continues English, German Wikipedia, arXiv",
        "LaTeX and code in the style of its corpus, without knowledge worth trusting.", "",
        "## Training", "",
        f"Command: `{command}`", "",
        "Corpus: `../shared/traces/olmoe-stats/text/` — Wikipedia, C4, arXiv, GitHub (books left out), split into",
        f"~{DOC_CHARS}-character documents; every {VALID_EVERY}th document is validation.", "",
        "| hyper-parameter | value |", "|---|---|",
        *(f"| {k} | {v} |" for k, v in asdict(h).items()), "",
        "## Results", "",
        "| measure | value |", "|---|---|",
        *(f"| {k} | {v} |" for k, v in results.items()), "",
        "## Greedy continuations (40 new tokens)", "",
        *(f"- **{p}**{json.dumps(c, ensure_ascii=False)[1:-1]}" for p, c in samples), "",
    ]
    (out / "README.md").write_text("\n".join(lines), encoding="utf-8")


def run(args: argparse.Namespace) -> None:
    from tokenizers import Tokenizer
    from transformers import Qwen3MoeForCausalLM

    h = Hyper(**{k: v for k, v in vars(args).items() if k in Hyper.__dataclass_fields__ and v is not None})
    torch.manual_seed(h.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    work, out = Path(args.work_dir), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    state_path = work / "state.pt"
    if state_path.exists() and not args.resume:
        sys.exit(f"error: {state_path} exists; pass --resume to continue it or remove {work}")
    train_docs, valid_docs = split_documents(Path(args.corpus))
    if not (work / "tokenizer.json").exists():
        train_tokenizer(train_docs, h.vocab_size, work)
    tokenizer = Tokenizer.from_file(str(work / "tokenizer.json"))
    train_ids, valid_ids = encode_stream(tokenizer, train_docs), encode_stream(tokenizer, valid_docs)
    print(f"corpus: {len(train_docs)} train / {len(valid_docs)} valid documents, "
          f"{len(train_ids):,} / {len(valid_ids):,} tokens", file=sys.stderr)

    model = Qwen3MoeForCausalLM(model_config(h, tokenizer.token_to_id(EOS)))
    opt = torch.optim.AdamW(model.parameters(), lr=h.lr, betas=(0.9, 0.95), weight_decay=h.weight_decay)
    step, log = 0, []
    if args.resume and state_path.exists():
        state = torch.load(state_path, weights_only=True)
        if state["hyper"] != asdict(h):
            changed = sorted(k for k in state["hyper"] if state["hyper"][k] != asdict(h)[k])
            sys.exit(f"error: {state_path} was trained with different hyper-parameters ({', '.join(changed)}); "
                     "resume with the same flags")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, log = state["step"], state["log"]
    if train_steps(args, h, model, opt, train_ids, valid_ids, step, log, work):
        finish(args, h, model, tokenizer, train_ids, valid_ids, log, work, out)


def train_steps(args, h: Hyper, model, opt, train_ids, valid_ids, step: int, log: list[dict], work: Path) -> bool:
    """Optimise from `step` to h.steps (or --stop-after steps); True when training is complete."""
    model.train()
    params = list(model.parameters())
    tokens_per_step = h.batch * h.seq_len
    bar = tqdm(total=h.steps, initial=step, desc="training", unit="step", dynamic_ncols=True)
    t0, start = time.perf_counter(), step
    while step < h.steps:
        for group in opt.param_groups:
            group["lr"] = lr_at(h, step)
        x = batch_at(train_ids, h, step)
        result = model(input_ids=x[:, :-1])
        lm_loss = torch.nn.functional.cross_entropy(result.logits.flatten(0, 1), x[:, 1:].flatten())
        (lm_loss + h.aux_loss_coef * result.aux_loss).backward()
        torch.nn.utils.clip_grad_norm_(params, h.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        lm, aux = lm_loss.item(), result.aux_loss.item()
        log.append({"step": step, "loss": round(lm, 4), "aux": round(aux, 4)})
        rate = (step - start) * tokens_per_step / (time.perf_counter() - t0)
        bar.set_postfix(loss=f"{lm:.3f}", aux=f"{aux:.3f}", tok_s=f"{rate:,.0f}")
        bar.update(1)
        if step % args.eval_every == 0 or step == h.steps:
            log[-1]["valid"] = round(evaluate(model, valid_ids, h.seq_len, max_windows=64), 4)
            bar.write(f"step {step}: train {lm:.3f}, valid (64 windows) {log[-1]['valid']:.3f}")
        stopping = bool(args.stop_after) and step - start >= args.stop_after and step < h.steps
        if step % args.save_every == 0 or step == h.steps or stopping:
            save_state(work, model, opt, step, log, asdict(h))
        if stopping:
            bar.close()
            print(f"stopped at step {step} (state saved); continue with --resume", file=sys.stderr)
            return False
    bar.close()
    return True


def finish(args, h: Hyper, model, tokenizer, train_ids, valid_ids, log, work: Path, out: Path) -> None:
    """Final evaluation, bf16 checkpoint, tokenizer and model card in `out` (written beside, then swapped in)."""
    valid = evaluate(model, valid_ids, h.seq_len)
    tail = [e["loss"] for e in log[-50:]]
    train = sum(tail) / len(tail)
    unigram = unigram_loss(train_ids, valid_ids, h.vocab_size)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.config.output_router_logits = False
    model.to(torch.bfloat16).save_pretrained(tmp)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(work / name, tmp / name)
    bf16_valid = evaluate(model, valid_ids, h.seq_len)
    results = {
        "train loss (mean of last 50 steps, fp32)": f"{train:.3f} (ppl {math.exp(train):.1f})",
        "validation loss (fp32)": f"{valid:.3f} (ppl {math.exp(valid):.1f})",
        "validation loss (bf16 checkpoint)": f"{bf16_valid:.3f} (ppl {math.exp(bf16_valid):.1f})",
        "unigram baseline on validation": f"{unigram:.3f} (ppl {math.exp(unigram):.1f})",
        "train / validation tokens": f"{len(train_ids):,} / {len(valid_ids):,}",
        "parameters": f"{sum(p.numel() for p in model.parameters()):,}",
        "training time": args.elapsed(),
    }
    write_card(tmp, h, args.command, results, greedy_continuations(model, tokenizer))
    (tmp / "training_log.json").write_text(json.dumps(log))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    for k, v in results.items():
        print(f"{k}: {v}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", default="../shared/traces/olmoe-stats/text", help="the olmoe-stats text directory")
    p.add_argument("--out", default="moepager/data/demo-moe", help="checkpoint directory to write")
    p.add_argument("--work-dir", default="build/demo-train", help="tokenizer and resumable training state")
    p.add_argument("--resume", action="store_true", help="continue from --work-dir/state.pt")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--stop-after", type=int, default=0,
                   help="stop after this many steps of this invocation (state saved; continue with --resume)")
    for name, field in Hyper.__dataclass_fields__.items():
        p.add_argument("--" + name.replace("_", "-"), type=type(field.default), default=None,
                       help=f"default {field.default}")
    args = p.parse_args(argv)
    args.command = "python scripts/train_demo_model.py " + " ".join(sys.argv[1:] if argv is None else argv)
    started = time.perf_counter()
    args.elapsed = lambda: f"{(time.perf_counter() - started) / 60:.1f} min (this invocation)"
    run(args)


if __name__ == "__main__":
    main()
