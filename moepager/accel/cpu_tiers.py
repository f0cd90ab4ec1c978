"""The CPU tiers of moepager's kernels (accel/csrc/): which instruction sets a build targets, which this CPU can run,
and which one a process uses.

One algorithm, written once over the operations of csrc/simd.h, is compiled once per tier with that tier's target
flags into a module of its own (accel/cpu_kernels.py): never `-march=native`, so a build cache shared between hosts
holds one build per tier and a host loads only a tier its CPU runs. The tiers, best first:

| tier | CPU | its dot products |
|---|---|---|
| avx512-bf16 | AVX-512 F/BW/VL/DQ/CD, BF16, VNNI (Zen 4/5, Sapphire Rapids, Cooper Lake) | vdpbf16ps, vpdpbusd |
| avx2 | AVX2, FMA, F16C, BMI1/2 (x86-64-v3: Haswell and later, every Zen) | bf16 widened by shifts, vpmaddubsw |
| neon-dotprod | ARM64 with dot products (Apple M1+, Graviton 2+, Ampere Altra, Cortex-A76+) | FMLA, SDOT |
| neon | any ARM64 | FMLA, widening multiplies |
| portable | any CPU: plain C++ (slow where the target lacks a fused multiply-add instruction) | std::fma |
| torch | none of ours: torch's own kernels (its oneDNN, FBGEMM and int4pack paths) | |

The tiers compute the same bits (csrc/simd.h states the two exceptions: subnormal bf16 operands, NaN payloads).
A CPU runs a tier when /proc/cpuinfo lists every feature the tier's flags let the compiler use; the build is then
trusted only after its self-test ran in a forked child (accel/cpu_kernels.py), since a hypervisor can list a feature
it does not provide. `MOEPAGER_CPU_TIER` forces a tier (a lower one on a faster CPU: how the suite runs every tier on
one host); naming one this CPU cannot run is an error that names those it can. `MOEPAGER_CPU_KERNELS=0` means torch.
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass
from functools import lru_cache

from moepager.errors import ConfigError

TORCH = "torch"
"""The tier name of torch's own kernels (moepager's turned off or unavailable)."""
ENV_TIER = "MOEPAGER_CPU_TIER"


@dataclass(frozen=True)
class Tier:
    """One target of the kernels' build."""

    name: str
    machine: str
    """`platform.machine()` it runs on ("" for any)."""
    needs: frozenset[str]
    """CPU features (/proc/cpuinfo's names) every one of which the target flags let the compiler use."""
    flags: tuple[str, ...]
    """The compiler's target flags (besides -O3 -ffp-contract=off -fopenmp)."""
    macro: str
    """The csrc/simd.h implementation: -DMOEPAGER_TIER_<macro>."""
    note: str
    """What its dot products are, for `moepager info`."""

    @property
    def module_name(self) -> str:
        return "moepager_cpu_" + self.name.replace("-", "_")


_X86_V2 = frozenset({"pni", "ssse3", "sse4_1", "sse4_2", "popcnt", "cx16", "lahf_lm"})
_X86_V3 = _X86_V2 | {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe", "xsave"}
_X86_V4 = _X86_V3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
X86, ARM = "x86_64", "aarch64"

TIERS: tuple[Tier, ...] = (
    Tier("avx512-bf16", X86, _X86_V4 | {"avx512_bf16", "avx512_vnni"},
         ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"), "AVX512",
         "bf16: AVX512-BF16, int8/int4: AVX512-VNNI"),
    Tier("avx2", X86, _X86_V3, ("-march=x86-64-v3",), "AVX2",
         "bf16: widened to fp32, FMA; int8/int4: AVX2 vpmaddubsw"),
    Tier("neon-dotprod", ARM, frozenset({"asimd", "asimddp"}), ("-march=armv8.2-a+dotprod",), "NEON",
         "bf16: widened to fp32, FMLA; int8/int4: SDOT"),
    Tier("neon", ARM, frozenset({"asimd"}), ("-march=armv8-a",), "NEON",
         "bf16: widened to fp32, FMLA; int8/int4: widening multiplies"),
    Tier("portable", "", frozenset(), (), "PORTABLE", "plain C++, no target flags"),
)
BY_NAME = {t.name: t for t in TIERS}
NAMES = (*BY_NAME, TORCH)


def portable_flags(machine: str) -> tuple[str, ...]:
    """The portable tier's flags: the architecture's baseline, stated, so a compiler defaulting to more is held back."""
    return {X86: ("-march=x86-64",), ARM: ("-march=armv8-a",)}.get(machine, ())


def flags_for(tier: Tier, machine: str | None = None) -> tuple[str, ...]:
    return tier.flags if tier.name != "portable" else portable_flags(machine or platform.machine())


ENV_FEATURES = "MOEPAGER_CPU_FEATURES"
"""Space-separated features to take instead of /proc/cpuinfo's: a host emulated as another (with ATEN_CPU_CAPABILITY
and ONEDNN_MAX_CPU_ISA for torch's kernels, the suite on an AVX-512 host runs as on AMD Zen 3). Naming a feature this
CPU lacks makes a tier's self-test fail, and the run falls back: it can only lower the tiers."""


@lru_cache(maxsize=1)
def cpu_features() -> frozenset[str]:
    """This CPU's features as the kernel reports them (/proc/cpuinfo `flags` on x86, `Features` on ARM), or those
    MOEPAGER_CPU_FEATURES names."""
    if os.environ.get(ENV_FEATURES):
        return frozenset(os.environ[ENV_FEATURES].split())
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def missing(tier: Tier, features: frozenset[str] | None = None, machine: str | None = None) -> list[str]:
    """What this CPU lacks to run `tier` (empty: it can)."""
    machine = machine or platform.machine()
    if tier.machine and tier.machine != machine:
        return [f"{tier.machine} (this is {machine})"]
    have = cpu_features() if features is None else features
    return sorted(tier.needs - have)


def runnable(features: frozenset[str] | None = None, machine: str | None = None) -> list[str]:
    """The tiers this CPU can run, best first, ending with portable and torch."""
    return [t.name for t in TIERS if not missing(t, features, machine)] + [TORCH]


def requested() -> str | None:
    """The tier the environment asks for (None: the best this CPU runs); a clear error for a tier it cannot run."""
    name = os.environ.get(ENV_TIER, "").strip()
    if not name:
        return TORCH if os.environ.get("MOEPAGER_CPU_KERNELS", "1") == "0" else None
    if name not in NAMES:
        raise ConfigError(f"{ENV_TIER}={name} is not a CPU tier; choose from {', '.join(NAMES)}")
    if name != TORCH and (lacks := missing(BY_NAME[name])):
        raise ConfigError(f"{ENV_TIER}={name}: this CPU cannot run it (it lacks {', '.join(lacks)}); it can run "
                          f"{', '.join(runnable())}")
    return name


def platform_reason() -> str | None:
    """Why no tier of ours can be built on this platform (None: it can)."""
    if sys.platform != "linux":
        return f"built on Linux only (this is {sys.platform})"
    return None
