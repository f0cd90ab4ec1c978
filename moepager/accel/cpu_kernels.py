"""moepager's own CPU expert kernels (accel/cpu_moe.cpp): one call per MoE layer for a few tokens, bf16 / int8 /
int4 experts read at the memory-bandwidth limit, and a bf16 GEMV for the dense projections.

Why our own C++ and not a library (measured on this project's 2-core Zen 5, 2026-11-27, `python -m benchmarks run
expert_kernels`): torch's bf16 GEMV and oneDNN read a layer's 3-6 MB expert matrices at 12-18 GB/s one call at a
time, `_weight_int8pack_mm` converts every weight to float (6-10 GB/s), `_weight_int4pack_mm_for_cpu` is
compute-bound, and every one of them is a call (and a Python dispatch) per expert and projection. ggml's kernels
have no maintained Python binding that takes our buffers (llama-cpp-python runs whole GGUF models only). The
extension here computes a whole layer in one call with AVX512-BF16 and AVX512-VNNI, threads split across experts
and rows (ATen's own thread pool: `torch.set_num_threads` governs it), nothing in Python per expert.

It is compiled at first use with `torch.utils.cpp_extension` (g++, `-O3 -march=native`, ~30 s on 2 cores) and cached
under MOEPAGER_CACHE (default ~/.cache/moepager); a later process loads the cached build in milliseconds. A CPU
without AVX512-BF16 and AVX512-VNNI, a missing compiler or ninja, or a failed build falls back to the torch kernels
with one line on stderr saying why; MOEPAGER_CPU_KERNELS=0 turns it off. `moepager info` and a run's statistics say
which kernels ran.

Numerics (not bit-equal to torch's kernels, so a kernel choice like `packed`; tested against the reference in
tests/accel/test_cpu_kernels.py): bf16 experts accumulate each dot product in fp32 (AVX512-BF16 pairs), SiLU(gate) *
up in fp32 rounded once to bf16, the routing-weighted sum in fp32 rounded once. int8 / int4 experts also quantize
the activations to 8 bits in blocks of 32 (one fp32 scale per block, as llama.cpp's Q8_0 activations): lossier than
the weight-only torch kernels, and said so in a run's report. Paged and resident layers run the same code in the
same order, so they agree bit for bit.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch

from moepager.errors import ConfigError
from moepager.experts.executor import SortedTokens
from moepager.experts.quant import sections
from moepager.experts.weights import ExpertShape

SOURCES = [Path(__file__).with_name(name) for name in ("cpu_moe.cpp", "cpu_step.cpp")]
"""The MoE layer's kernels and the dense GEMV (cpu_moe.cpp); the rest of a decode step (cpu_step.cpp, accel/step.py)."""
HEADERS = sorted(Path(__file__).parent.glob("cpu_*.h"))
_lock = threading.Lock()
_state: dict[str, object] = {}

FORMAT_CODES = {"bf16": 0, "int8": 1, "int4": 2}


def cache_dir() -> Path:
    """Where compiled extensions are kept: MOEPAGER_CACHE or ~/.cache/moepager, one folder per torch version."""
    root = Path(os.environ.get("MOEPAGER_CACHE") or Path.home() / ".cache" / "moepager")
    return root / f"torch_extensions-{torch.__version__}"


def unsupported_reason() -> str | None:
    """Why the extension cannot be used on this machine (None: it can be built here)."""
    if os.environ.get("MOEPAGER_CPU_KERNELS", "1") == "0":
        return "MOEPAGER_CPU_KERNELS=0"
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"built for x86-64 Linux only (this is {sys.platform} {platform.machine()})"
    if not (torch.cpu._is_avx512_bf16_supported() and torch.cpu._is_vnni_supported()):
        return "this CPU lacks AVX512-BF16 or AVX512-VNNI"
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


def _build() -> ModuleType:
    """Build (or load the cached build of) the extension. Processes building at once take turns on an flock of ours,
    which the system releases when its holder dies; torch's own lock file (`lock`, created and deleted by `load`) is
    left behind by a build that was killed, and every later `load` would wait for it forever. Holding our flock, a
    `lock` file is such a leftover and is deleted."""
    import fcntl

    from torch.utils.cpp_extension import load
    build = cache_dir() / "moepager_cpu_moe"
    build.mkdir(parents=True, exist_ok=True)
    # `load` hashes the sources only: the headers' hash in a -D flag makes a header edit rebuild too
    header = hashlib.sha256(b"".join(h.read_bytes() for h in HEADERS)).hexdigest()[:16]
    with open(build / "moepager.flock", "w") as turn:
        fcntl.flock(turn, fcntl.LOCK_EX)
        stale = build / "lock"
        if stale.exists():
            print(f"moepager: removing {stale}, left by a build of the CPU kernels that was stopped", file=sys.stderr)
            stale.unlink(missing_ok=True)
        return load("moepager_cpu_moe", [str(s) for s in SOURCES], build_directory=str(build), verbose=False,
                    extra_cflags=["-O3", "-march=native", "-fopenmp", f"-DMOEPAGER_HEADERS={header}"],
                    extra_ldflags=["-fopenmp"])


def extension() -> ModuleType | None:
    """The compiled extension, built on first use (None when it cannot be used here: `status()` says why)."""
    with _lock:
        if "module" not in _state:
            reason = unsupported_reason()
            module = None
            if reason is None:
                try:
                    module = _build()
                except Exception as e:  # noqa: BLE001 - any build failure falls back, with its reason
                    reason = f"the build failed ({str(e).strip().splitlines()[-1][:200] if str(e).strip() else e})"
            if module is None and reason != "MOEPAGER_CPU_KERNELS=0":
                print(f"moepager: CPU expert kernels unavailable, using torch's: {reason}", file=sys.stderr)
            _state["module"], _state["reason"] = module, reason
        return _state["module"]  # type: ignore[return-value]


def status() -> str:
    """One line for `info` and run statistics: which CPU kernels run, or why not ours."""
    module = extension()
    if module is not None:
        return "moepager AVX512 (bf16: AVX512-BF16, int8/int4: VNNI, 8-bit activations; and the rest of a bf16 " \
            "decode step)"
    return f"torch's (ours unavailable: {_state.get('reason')})"


def available() -> bool:
    return extension() is not None


def built() -> ModuleType | None:
    """The extension if this process has already built or loaded it, else None (never builds: for callers on every
    step, such as the sampler, that use it only where a run already does)."""
    return _state.get("module")  # type: ignore[return-value]


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


def _spec(shape: ExpertShape) -> list[int]:
    d, f = shape.hidden, shape.intermediate
    if shape.quant is None:
        return [FORMAT_CODES["bf16"], d, f, 0, 0, 2 * f * d * 2, 0, 0]
    secs, _ = sections(d, f, shape.dtype, shape.quant)
    code = FORMAT_CODES["int8" if shape.quant.bits == 8 else "int4"]
    return [code, d, f, shape.quant.group, *(s.offset for s in secs)]


class FusedExperts:
    """The extension bound to one expert format: a layer's experts in one call (experts/protocols.py's
    `FusedKernel`, which the executors take from the composition root)."""

    def __init__(self, shape: ExpertShape, max_tokens: int):
        module = extension()
        assert module is not None
        self.module, self.spec, self.max_tokens = module, _spec(shape), max_tokens
        calls = "" if max_tokens >= 1 << 62 else f" on up to {max_tokens} tokens a layer"
        self.note = f"moepager's fused CPU kernel{calls}" + (
            "" if shape.quant is None else ", activations quantized to 8 bits in blocks of 32")

    def resident(self, x_ND: torch.Tensor, ids_NK: torch.Tensor, weights_NK: torch.Tensor, arena: torch.Tensor,
                 base: int, count: int) -> torch.Tensor:
        """The layer's output: experts e at arena rows base + e."""
        return self.module.moe_resident(x_ND.contiguous(), ids_NK, weights_NK, arena, base, count, self.spec)

    def rows(self, work: SortedTokens, rows: Sequence[int], which: Sequence[int], y_MD: torch.Tensor, *,
             x_ND: torch.Tensor, w_M: torch.Tensor, arena: torch.Tensor) -> None:
        """Experts `which` (indices into work.experts, at arena rows rows[i]) into their weighted fp32 rows of y_MD."""
        if which:
            starts = work.starts
            self.module.moe_partial(x_ND.contiguous(), arena, work.token_M, w_M, torch.tensor([rows[i] for i in which]),
                                    torch.tensor([(starts[i], starts[i + 1]) for i in which]), y_MD, self.spec)

    def combine(self, y_MD: torch.Tensor, token_M: torch.Tensor, n: int) -> torch.Tensor:
        return self.module.moe_combine(y_MD, token_M, n)


def fused_experts(shape: ExpertShape, device: torch.device, kernel: str) -> FusedExperts | None:
    """The fused kernel for these experts when `kernel` asks for it (`fused`: always, else a clear error; `auto`:
    where it applies, FUSED_MAX_TOKENS tokens for float experts), else None."""
    if kernel == "fused":
        reason = "it runs on the CPU" if device.type != "cpu" else unsupported_format(shape) or (
            None if available() else str(_state.get("reason")))
        if reason is not None:
            raise ConfigError(f"the 'fused' expert kernel cannot compute these {shape.format_name} experts: "
                              f"{reason}; choose another --expert-kernel")
        return FusedExperts(shape, 1 << 62)
    if not applies(shape, device, kernel):
        return None
    return FusedExperts(shape, FUSED_MAX_TOKENS if shape.quant is None else 1 << 62)
