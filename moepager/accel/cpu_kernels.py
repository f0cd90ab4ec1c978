"""moepager's own CPU kernels (accel/csrc/): one call per MoE layer for a few tokens, bf16 / int8 / int4 experts read
at the memory-bandwidth limit, a bf16 GEMV for the dense projections and the rest of a decode step, built for the CPU
tier this machine runs (accel/cpu_tiers.py: avx512-bf16, avx2, neon-dotprod, neon, portable).

Why our own C++ and not a library (`python -m benchmarks run expert_kernels` measures it): torch's bf16 GEMV and
oneDNN read a layer's expert matrices well below the memory bandwidth one call at a time, `_weight_int8pack_mm`
converts every weight to float, `_weight_int4pack_mm_for_cpu` is compute-bound, and every one of them is a call (and
a Python dispatch) per expert and projection. ggml's kernels
have no maintained Python binding that takes our buffers (llama-cpp-python runs whole GGUF models only). The
extension here computes a whole layer in one call, threads split across experts and rows (ATen's own thread pool:
`torch.set_num_threads` governs it), nothing in Python per expert.

Each tier is compiled at first use with `torch.utils.cpp_extension` (g++, -O3 and the tier's target flags, under a
minute on 2 cores) into a library of its own (torch.library operators in the tier's namespace: accel/ops.py) and
cached under MOEPAGER_CACHE (default ~/.cache/moepager), in a folder
named by the tier, the compiler, torch's version and the kernels' sources (where they lie and what they hold), so a
cache shared between hosts never hands a build to a CPU that cannot run it, and two copies of moepager on one machine
(an installed one and a checkout, two checkouts) never rebuild each other's kernels; a later process loads its build
in milliseconds. A build is used only once its self-test has run in a forked child
and computed the bits every tier computes. A tier that cannot be built or fails its self-test falls back to the next
one, and a missing compiler or ninja to torch's kernels, with one line on stderr saying which runs and why.
`MOEPAGER_CPU_TIER` forces a tier, `MOEPAGER_CPU_KERNELS=0` means torch's. `moepager info` and a run's statistics
name the tier.

Numerics (not bit-equal to torch's kernels, so a kernel choice like `packed`; tested against the reference in
tests/accel/test_cpu_kernels.py, and tier against tier in tests/accel/test_cpu_tiers.py): bf16 experts accumulate
each dot product in fp32 (pairs of bf16 products), SiLU(gate) * up in fp32 rounded once to bf16, the routing-weighted
sum in fp32 rounded once. int8 / int4 experts also quantize the activations to 8 bits in blocks of 32 (one fp32 scale
per block, as llama.cpp's Q8_0 activations): lossier than the weight-only torch kernels, and said so in a run's
report. Paged and resident layers run the same code in the same order, so they agree bit for bit; so do the tiers.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from moepager.accel import cpu_tiers
from moepager.accel.cpu_tiers import TORCH, Tier
from moepager.accel.ops import FormatSpec, Kernels
from moepager.errors import ConfigError
from moepager.experts.sorting import SortedTokens
from moepager.experts.weights import ExpertShape

CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / "moe.cpp", CSRC / "step.cpp"]
"""The torch bindings (the MoE layer and the GEMV; the rest of a decode step), each including the torch-free core."""
HEADERS = sorted(CSRC.glob("*.h"))
BASE_FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-std=c++17", "-fvisibility=hidden")
"""Every tier's flags besides its target: no contraction of a * b + c into one fused operation but where the code
says so, which keeps the tiers' arithmetic one and the same."""
SELFTEST = 4821114524833950398
"""What every tier's `selftest()` returns (csrc/moe.cpp)."""

_lock = threading.Lock()


@dataclass
class Selected:
    """The kernels this process runs: a tier's module, or None for torch's, and why when not the one asked for."""

    tier: str
    module: Kernels | None
    reason: str | None = None


_state: Selected | None = None
_modules: dict[str, Kernels] = {}


def cache_dir() -> Path:
    """Where compiled extensions are kept: MOEPAGER_CACHE or ~/.cache/moepager, one folder per torch version."""
    root = Path(os.environ.get("MOEPAGER_CACHE") or Path.home() / ".cache" / "moepager")
    return root / f"torch_extensions-{torch.__version__}"


@functools.lru_cache(maxsize=1)
def unsupported_reason() -> str | None:
    """Why no tier of ours can be built on this machine (None: they can); looked at once per process (it runs
    `ninja --version`)."""
    if (reason := cpu_tiers.platform_reason()) is not None:
        return reason
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler (c++) on PATH"
    beside = Path(sys.executable).parent  # the `ninja` dependency's script, in a virtual environment not activated
    if shutil.which("ninja") is None and (beside / "ninja").exists():
        os.environ["PATH"] = f"{beside}{os.pathsep}{os.environ.get('PATH', '')}"
    try:
        from torch.utils.cpp_extension import verify_ninja_availability
        verify_ninja_availability()
    except RuntimeError:
        return "ninja is not installed (pip install ninja)"
    return None


@functools.lru_cache(maxsize=None)
def _compiler() -> str:
    """The C++ compiler's version line (part of a build's key; asked once per process)."""
    try:
        out = subprocess.run([os.environ.get("CXX", "c++"), "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0] if out.stdout else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


class Sources(NamedTuple):
    """The kernels' sources as a build knows them: where they lie and a hash of what they hold. torch's `load` names
    its sources by path and rebuilds when the paths or flags it was given last time differ, so two copies of the
    sources sharing one folder would rebuild it at every switch."""

    folder: str
    digest: str

    def note(self) -> str:
        """What a build folder keeps of them (SOURCES_NOTE): the folder's line, then the digest's."""
        return f"{self.folder}\n{self.digest}"


@functools.lru_cache(maxsize=1)
def sources_key() -> Sources:
    """These sources (read once per process)."""
    return Sources(str(CSRC.resolve()),
                   hashlib.sha256(b"".join(f.read_bytes() for f in [*SOURCES, *HEADERS])).hexdigest()[:16])


def build_dir(tier: Tier) -> Path:
    """The tier's build folder: named by the tier and a hash of its flags, the compiler and the sources (torch's
    version names the folder above)."""
    flags = BASE_FLAGS + cpu_tiers.flags_for(tier)
    key = hashlib.sha256("\n".join((_compiler(), *flags, *sources_key())).encode()).hexdigest()[:12]
    return cache_dir() / f"{tier.module_name}-{key}"


def _build(tier: Tier) -> str:
    """Build (or load the cached build of) one tier's library, and load it into this process (its operators and
    classes register themselves: accel/ops.py); returns the library's path. Processes building at once take turns on
    an flock of ours, which the system releases when its holder dies; torch's own lock file (`lock`, created and
    deleted by `load`) is left behind by a build that was killed, and every later `load` would wait for it forever.
    Holding our flock, a `lock` file is such a leftover and is deleted."""
    import fcntl

    from torch.utils.cpp_extension import load
    build = build_dir(tier)
    build.mkdir(parents=True, exist_ok=True)
    # `load` hashes the sources only: the sources' hash in a -D flag makes a header edit rebuild too
    header = sources_key().digest
    flags = [*BASE_FLAGS, *cpu_tiers.flags_for(tier), f"-DMOEPAGER_TIER_{tier.macro}", "-DMOEPAGER_WITH_TORCH",
             f"-DMOEPAGER_HEADERS={header}"]
    if not list(build.glob(f"{tier.module_name}*.so")):  # a first build takes a minute: say so, not silence
        print(f"moepager: building the CPU kernels for {tier.name} (once on this machine, about a minute) ...",
              file=sys.stderr, flush=True)
        prune_superseded(tier, build)
        (build / SOURCES_NOTE).write_text(sources_key().note())  # a folder is new with each version of the sources
    with open(build / "moepager.flock", "w") as turn:
        fcntl.flock(turn, fcntl.LOCK_EX)
        stale = build / "lock"
        if stale.exists():
            print(f"moepager: removing {stale}, left by a build of the CPU kernels that was stopped", file=sys.stderr)
            stale.unlink(missing_ok=True)
        return load(tier.module_name, [str(s) for s in SOURCES], build_directory=str(build), verbose=False,
                    extra_cflags=flags, extra_ldflags=["-fopenmp"], is_python_module=False)


SOURCES_NOTE = "sources"
"""A build folder's note of the sources it was built from (`sources_key`: their folder, then their hash)."""


def prune_superseded(tier: Tier, build: Path) -> list[Path]:
    """The folders of `tier` built from earlier versions of these same sources (the same folder, another hash),
    removed when `build` replaces them, so edits of a checkout do not pile builds up; another copy's folders are kept
    (and a process still running an old build keeps its module: the system frees the files when it exits). Returns
    the folders removed."""
    where = sources_key().folder
    gone = []
    for other in build.parent.glob(f"{tier.module_name}-*"):
        note = other / SOURCES_NOTE
        if other != build and note.exists() and note.read_text().split("\n", 1)[0] == where:
            shutil.rmtree(other, ignore_errors=True)
            gone.append(other)
    return gone


def self_test(module: Kernels) -> str | None:
    """Run the module's self-test in a forked child (an instruction this CPU lacks kills the child, not us): None if
    it computed SELFTEST, else what went wrong."""
    with warnings.catch_warnings():  # Python 3.12 warns of fork() in a threaded process; the child only computes
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            code = 0 if module.selftest() == SELFTEST else 3
        except BaseException:  # noqa: BLE001 - any failure is the answer
            code = 4
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return f"its self-test died of {signal.Signals(os.WTERMSIG(status)).name}"
    code = os.WEXITSTATUS(status)
    return None if code == 0 else "its self-test computed the wrong bits" if code == 3 else "its self-test failed"


def module_for(tier_name: str) -> Kernels:
    """One tier's module, built (or loaded) and self-tested, whatever this process runs (tests compare tiers with
    it); an error saying why it cannot be used."""
    if tier_name in _modules:
        return _modules[tier_name]
    tier = cpu_tiers.BY_NAME[tier_name]
    if lacks := cpu_tiers.missing(tier):
        raise ConfigError(f"this CPU cannot run the {tier_name} kernels (it lacks {', '.join(lacks)})")
    if (reason := unsupported_reason()) is not None:
        raise ConfigError(reason)
    try:
        module = Kernels(tier.module_name, _build(tier))
    except Exception as e:  # noqa: BLE001 - any build failure is reported with its last line
        text = str(e).strip()
        raise ConfigError(f"the {tier_name} build failed ({text.splitlines()[-1][:200] if text else e})") from e
    if (reason := self_test(module)) is not None:
        raise ConfigError(f"the {tier_name} build cannot run here: {reason}")
    _modules[tier_name] = module
    return module


def _select() -> Selected:
    """The best tier this CPU runs (or the one MOEPAGER_CPU_TIER names), falling back tier by tier to torch's."""
    wanted = cpu_tiers.requested()
    if wanted == TORCH:
        return Selected(TORCH, None, f"{cpu_tiers.ENV_TIER}=torch" if os.environ.get(cpu_tiers.ENV_TIER) else
                        "MOEPAGER_CPU_KERNELS=0")
    runnable = [t for t in cpu_tiers.runnable() if t != TORCH]
    tried: list[str] = []
    if (reason := unsupported_reason()) is not None:
        tried.append(reason)
    else:
        for name in runnable[runnable.index(wanted):] if wanted else runnable:
            try:
                module = module_for(name)
            except ConfigError as e:
                tried.append(str(e))
                continue
            first = wanted or runnable[0]
            if name != first:
                print(f"moepager: CPU kernels: {name} ({'; '.join(tried)})", file=sys.stderr)
            return Selected(name, module, "; ".join(tried) or None)
    reason = "; ".join(tried)
    print(f"moepager: CPU expert kernels unavailable, using torch's: {reason}", file=sys.stderr)
    return Selected(TORCH, None, reason)


def selected() -> Selected:
    """The kernels this process runs, chosen at first use (once per process)."""
    global _state
    with _lock:
        if _state is None:
            _state = _select()
        return _state


def extension() -> Kernels | None:
    """The compiled extension of this process's tier, built on first use (None when torch's kernels run: `status()`
    says why)."""
    return selected().module


def tier() -> str:
    """The tier this process's CPU kernels run (`avx512-bf16`, `avx2`, ..., `portable`, or `torch`)."""
    return selected().tier


def chosen_tier() -> str | None:
    """The tier this process chose, if it has chosen one yet (never builds: for a run's statistics)."""
    return None if _state is None else _state.tier


def status() -> str:
    """One line for `info` and run statistics: which CPU kernels run, or why not ours."""
    chosen = selected()
    if chosen.module is None:
        return f"torch's (ours unavailable: {chosen.reason})"
    line = f"moepager {chosen.tier} ({cpu_tiers.BY_NAME[chosen.tier].note}; and the rest of a bf16 decode step)"
    return line if chosen.reason is None else f"{line}; not a higher tier: {chosen.reason}"


def available() -> bool:
    return extension() is not None


def built() -> Kernels | None:
    """The extension if this process has already chosen it, else None (never builds: for callers on every step, such
    as the sampler, that use it only where a run already does)."""
    return None if _state is None else _state.module


# ---- bound to one expert format ------------------------------------------------------------------------------

FUSED_MAX_TOKENS = 128
"""`--expert-kernel auto` computes float experts with the fused kernel on up to this many tokens a layer call
(decode, batched decode, prefill chunks); more go to torch's GEMMs. One qwen3-30b-a3b layer (128 experts, top-8),
fused against torch's `grouped`, 1 / 2 threads: 2.0x / 1.6x at 32 tokens, 1.2x / 1.6x at 128, 1.0x / 1.1x at 256
(`python -m benchmarks run cpu_kernels --tokens 32 128 256`, 2026-11-27). Quantized experts take it at every size
(torch's own int8/int4 kernels are slower still there: benchmarks/README.md, cpu_kernels)."""


def unsupported_format(shape: ExpertShape) -> str | None:
    """Why the fused kernel cannot compute experts of this format (None: it can)."""
    quant = shape.quant
    if shape.dtype != torch.bfloat16:
        return f"it computes in bf16 (this run is {str(shape.dtype).removeprefix('torch.')})"
    if quant is not None and quant.bits == 4:
        if quant.zero_point:
            return "its int4 is symmetric (Q4_0's); these groups have zero points"
        if quant.group % 32:
            return f"its int4 groups are multiples of 32 (these are {quant.group})"
        if quant.layout != "rows":
            return f"it reads int4 in the 'rows' layout (these are held in the '{quant.layout}' layout)"
    return None


def applies(shape: ExpertShape, device: torch.device, kernel: str) -> bool:
    """Whether `kernel` (auto or fused) will compute these experts with the fused kernel on `device` (what decides
    the int4 layout a run holds its experts in: plain nibbles for this kernel, torch's int4pack otherwise)."""
    return kernel in ("auto", "fused") and device.type == "cpu" and unsupported_format(shape) is None \
        and available()


class FusedExperts:
    """The extension bound to one expert format: a layer's experts in one call (experts/protocols.py's
    `FusedKernel`, which the executors take from the composition root)."""

    def __init__(self, shape: ExpertShape, max_tokens: int, module: Kernels | None = None):
        """`module`: a tier's kernels (`module_for`; default: this process's tier)."""
        module = module or extension()
        assert module is not None
        self.module, self.spec, self.max_tokens = module, FormatSpec.of(shape), max_tokens
        self.format = self.spec._asdict()
        """The format as the operators take it: its fields by name (accel/ops.py)."""
        calls = "" if max_tokens >= 1 << 62 else f" on up to {max_tokens} tokens a layer"
        self.note = f"moepager's fused CPU kernel{calls}" + (
            "" if shape.quant is None else ", activations quantized to 8 bits in blocks of 32")

    def resident(self, x_ND: torch.Tensor, ids_NK: torch.Tensor, weights_NK: torch.Tensor, arena: torch.Tensor,
                 base: int, count: int) -> torch.Tensor:
        """The layer's output: experts e at arena rows base + e."""
        return self.module.moe_resident(x_ND.contiguous(), ids_NK, weights_NK, arena, base, count, **self.format)

    def rows(self, work: SortedTokens, rows: Sequence[int], which: Sequence[int], y_MD: torch.Tensor, *,
             x_ND: torch.Tensor, w_M: torch.Tensor, arena: torch.Tensor) -> None:
        """Experts `which` (indices into work.experts, at arena rows rows[i]) into their weighted fp32 rows of y_MD."""
        if which:
            starts = work.starts
            self.module.moe_partial(x_ND.contiguous(), arena, work.token_M, w_M, torch.tensor([rows[i] for i in which]),
                                    torch.tensor([(starts[i], starts[i + 1]) for i in which]), y_MD,
                                    **self.format)

    def combine(self, y_MD: torch.Tensor, token_M: torch.Tensor, n: int) -> torch.Tensor:
        return self.module.moe_combine(y_MD, token_M, n)


def fused_experts(shape: ExpertShape, device: torch.device, kernel: str) -> FusedExperts | None:
    """The fused kernel for these experts when `kernel` asks for it (`fused`: always, else a clear error; `auto`:
    where it applies, FUSED_MAX_TOKENS tokens for float experts), else None."""
    if kernel == "fused":
        reason = "it runs on the CPU" if device.type != "cpu" else unsupported_format(shape) or (
            None if available() else str(selected().reason))
        if reason is not None:
            raise ConfigError(f"the 'fused' expert kernel cannot compute these {shape.format_name} experts: "
                              f"{reason}; choose another --expert-kernel")
        return FusedExperts(shape, 1 << 62)
    if not applies(shape, device, kernel):
        return None
    return FusedExperts(shape, FUSED_MAX_TOKENS if shape.quant is None else 1 << 62)
