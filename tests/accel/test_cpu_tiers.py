"""moepager's CPU tiers (accel/cpu_tiers.py, accel/csrc/): which tiers a CPU runs, the choice and its fallbacks, the
`MOEPAGER_CPU_TIER` switch, every tier this CPU runs built and giving the native tier's bits end to end (every
architecture's tiny checkpoint, bf16 / int8 / int4, the CLI and the server), and the torch-free kernel harness on
every x86 tier here. The ARM64 tiers, cross-compiled and run under qemu-user, and the avx2 tier under an emulated CPU
without AVX-512: `-m emulated` (.ci/run runs them).

The tiers' contract (csrc/simd.h): the same bits, but where a bf16 operand or product is subnormal (AVX512-BF16
flushes it) and in NaN payloads; the inputs here have neither, so every comparison is exact."""

from __future__ import annotations

import os
import platform
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from moepager.accel import cpu_kernels, cpu_tiers
from moepager.errors import ConfigError
from moepager.runtime.builder import load_model
from tests.conftest import ARCHS, OUR_TIERS
from tests.runtime.test_offload import logits_run

CSRC = Path(cpu_kernels.__file__).with_name("csrc")
ZEN3 = frozenset("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht "
                 "syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl nonstop_tsc cpuid "
                 "extd_apicid tsc_known_freq pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt aes "
                 "xsave avx f16c rdrand hypervisor lahf_lm cmp_legacy cr8_legacy abm sse4a misalignsse 3dnowprefetch "
                 "osvw topoext invpcid_single ssbd ibrs ibpb stibp vmmcall fsgsbase tsc_adjust bmi1 avx2 smep bmi2 "
                 "erms invpcid rdseed adx smap clflushopt clwb sha_ni xsaveopt xsavec xgetbv1 xsaves clzero xsaveerptr "
                 "wbnoinvd arat npt nrip_save umip pku ospke vaes vpclmulqdq rdpid fsrm".split())
"""/proc/cpuinfo's flags on this project's AMD EPYC Zen 3 host (FACTS.md): AVX2, no AVX-512."""
ZEN5 = ZEN3 | {"avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "avx512ifma",
               "avx512vbmi", "avx_vnni"}
GRAVITON2 = frozenset("fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop "
                      "asimddp ssbs".split())
CORTEX_A53 = frozenset("fp asimd evtstrm aes pmull sha1 sha2 crc32 cpuid".split())


@pytest.mark.parametrize("features, machine, tiers", [
    (ZEN5, "x86_64", ["avx512-bf16", "avx2", "portable", "torch"]),
    (ZEN3, "x86_64", ["avx2", "portable", "torch"]),
    (ZEN5 - {"avx512_bf16"}, "x86_64", ["avx2", "portable", "torch"]),  # Ice Lake: AVX-512 without BF16
    (frozenset({"sse2"}), "x86_64", ["portable", "torch"]),
    (GRAVITON2, "aarch64", ["neon-dotprod", "neon", "portable", "torch"]),
    (CORTEX_A53, "aarch64", ["neon", "portable", "torch"]),
    (frozenset(), "riscv64", ["portable", "torch"]),
])
def test_a_cpu_runs_the_tiers_its_features_allow(features, machine, tiers):
    assert cpu_tiers.runnable(features, machine) == tiers


def test_every_tier_this_cpu_runs_is_built_and_none_is_skipped():
    """The tiers this host runs, read off /proc/cpuinfo here independently of cpu_tiers, are all in OUR_TIERS, and each
    builds, passes its self-test and says which it is: a tier the CPU supports cannot be silently left out."""
    if cpu_tiers.platform_reason():
        pytest.skip(cpu_tiers.platform_reason())
    flags = set(os.environ.get("MOEPAGER_CPU_FEATURES", "").split() or Path("/proc/cpuinfo").read_text().split())
    expected = {"portable"}
    if platform.machine() == "x86_64":
        expected |= {"avx2"} if {"avx2", "fma", "f16c"} <= flags else set()
        expected |= {"avx512-bf16"} if {"avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"} <= flags else set()
    if platform.machine() == "aarch64":
        expected |= {"neon"} | ({"neon-dotprod"} if "asimddp" in flags else set())
    assert expected <= set(OUR_TIERS)
    for name in OUR_TIERS:
        module = cpu_kernels.module_for(name)
        assert module.tier == name
        if platform.machine() == "x86_64" and name != "avx512-bf16" and shutil.which("objdump"):
            code = subprocess.run(["objdump", "-d", module.path], capture_output=True, text=True).stdout
            assert "%zmm" not in code, f"the {name} build holds AVX-512 instructions"


def test_with_no_setting_the_best_tier_this_cpu_runs_is_chosen(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_state", None)
    monkeypatch.delenv("MOEPAGER_CPU_TIER", raising=False)
    monkeypatch.delenv("MOEPAGER_CPU_KERNELS", raising=False)
    assert cpu_kernels.tier() == OUR_TIERS[0]
    assert cpu_kernels.status().startswith(f"moepager {OUR_TIERS[0]} (")


@pytest.mark.parametrize("name", [*OUR_TIERS[1:], "torch"])
def test_moepager_cpu_tier_forces_a_lower_tier(monkeypatch, capsys, name):
    monkeypatch.setattr(cpu_kernels, "_state", None)
    monkeypatch.setenv("MOEPAGER_CPU_TIER", name)
    assert cpu_kernels.tier() == name
    said = [line for line in capsys.readouterr().err.splitlines() if "building the CPU kernels" not in line]
    assert (cpu_kernels.extension() is None) == (name == "torch") and said == []
    if name == "torch":
        assert cpu_kernels.status() == "torch's (ours unavailable: MOEPAGER_CPU_TIER=torch)"


def test_a_tier_this_cpu_cannot_run_is_one_error_naming_those_it_can(monkeypatch):
    monkeypatch.setattr(cpu_tiers, "cpu_features", lambda: ZEN3)
    monkeypatch.setattr(cpu_tiers.platform, "machine", lambda: "x86_64")
    monkeypatch.setenv("MOEPAGER_CPU_TIER", "avx512-bf16")
    with pytest.raises(ConfigError) as e:
        cpu_tiers.requested()
    assert str(e.value) == ("MOEPAGER_CPU_TIER=avx512-bf16: this CPU cannot run it (it lacks avx512_bf16, avx512_vnni, "
                            "avx512bw, avx512cd, avx512dq, avx512f, avx512vl); it can run avx2, portable, torch")
    monkeypatch.setenv("MOEPAGER_CPU_TIER", "avx3")
    with pytest.raises(ConfigError, match=r"MOEPAGER_CPU_TIER=avx3 is not a CPU tier; choose from avx512-bf16, avx2, "
                                          r"neon-dotprod, neon, portable, torch"):
        cpu_tiers.requested()


def test_the_cli_says_a_bad_tier_in_one_line_with_exit_code_2():
    env = {**os.environ, "MOEPAGER_CPU_TIER": "neon" if platform.machine() == "x86_64" else "avx2"}
    run = subprocess.run([sys.executable, "-m", "moepager.cli.main", "generate", "--max-tokens", "2", "hi"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert "this CPU cannot run it" in run.stderr and "it can run" in run.stderr


def test_each_tier_builds_in_a_folder_of_its_own_keyed_by_flags_and_compiler(monkeypatch, tmp_path):
    monkeypatch.setenv("MOEPAGER_CACHE", str(tmp_path))
    dirs = {cpu_kernels.build_dir(t) for t in cpu_tiers.TIERS}
    assert len(dirs) == len(cpu_tiers.TIERS) and all(d.parent == cpu_kernels.cache_dir() for d in dirs)
    assert len({t.module_name for t in cpu_tiers.TIERS}) == len(cpu_tiers.TIERS)
    before = cpu_kernels.build_dir(cpu_tiers.BY_NAME["avx2"])
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda: "g++ (Debian 13.1.0-1) 13.1.0")
    assert cpu_kernels.build_dir(cpu_tiers.BY_NAME["avx2"]) != before


def test_two_copies_of_the_sources_build_in_folders_of_their_own(monkeypatch, tmp_path):
    """An installed moepager and a checkout (or two checkouts) on one machine: torch's `load` rebuilds a folder whose
    sources were named by other paths last time, so shared folders would rebuild at every switch between the copies
    (a minute each, every process of the other copy waiting for it); a folder per copy, and per version of its
    sources, never does."""
    monkeypatch.setenv("MOEPAGER_CACHE", str(tmp_path))
    tier = cpu_tiers.BY_NAME["portable"]
    here = cpu_kernels.build_dir(tier)
    copy = tmp_path / "other" / "csrc"
    shutil.copytree(cpu_kernels.CSRC, copy)
    for name in ("CSRC", "SOURCES", "HEADERS"):
        value = getattr(cpu_kernels, name)
        monkeypatch.setattr(cpu_kernels, name, copy if name == "CSRC" else
                            [copy / f.name for f in value])
    cpu_kernels.sources_key.cache_clear()
    try:
        there = cpu_kernels.build_dir(tier)
        (copy / "rows.h").write_text((copy / "rows.h").read_text() + "\n// edited\n")
        cpu_kernels.sources_key.cache_clear()
        edited = cpu_kernels.build_dir(tier)
    finally:
        cpu_kernels.sources_key.cache_clear()
    assert len({here, there, edited}) == 3 and here.parent == there.parent == edited.parent


def test_a_new_build_of_edited_sources_removes_this_copys_earlier_builds_only(monkeypatch, tmp_path):
    monkeypatch.setenv("MOEPAGER_CACHE", str(tmp_path))
    tier = cpu_tiers.BY_NAME["portable"]
    here = cpu_kernels.build_dir(tier)
    where = cpu_kernels.sources_key().folder
    folders = {name: here.parent / f"{tier.module_name}-{name}" for name in ("older", "other-copy", "unnoted")}
    for name, folder in folders.items():
        folder.mkdir(parents=True)
        if name != "unnoted":
            (folder / cpu_kernels.SOURCES_NOTE).write_text(f"{where if name == 'older' else '/elsewhere'}\nabc")
    here.mkdir()
    assert cpu_kernels.prune_superseded(tier, here) == [folders["older"]]
    assert sorted(p.name for p in here.parent.iterdir()) == sorted(
        [here.name, folders["other-copy"].name, folders["unnoted"].name])


# ---- the same bits on every tier, end to end -------------------------------------------------------------------


def run_on(name: str, monkeypatch, path: Path, expert_dtype: str | None) -> list[torch.Tensor]:
    monkeypatch.setattr(cpu_kernels, "_state", cpu_kernels.Selected(name, cpu_kernels.module_for(name)))
    loaded = load_model(path, dtype=torch.bfloat16, expert_dtype=expert_dtype, show_progress=False)
    assert loaded.experts.kernels.fused is not None and loaded.experts.kernels.fused.module.tier == name
    return logits_run(loaded, steps=4, rows=2)


@pytest.mark.parametrize("expert_dtype", [None, "int8"])
@pytest.mark.parametrize("arch", ARCHS)
def test_every_tier_gives_the_native_tiers_logits_on_every_architecture(hf_checkpoint, monkeypatch, arch,
                                                                        expert_dtype):
    """A prefill of two rows and four decode passes (the engine's paged KV cache, the dense GEMV, the step kernels, the
    fused experts), bf16 and int8 experts: every lower tier's logits equal the native tier's bit for bit."""
    _, path = hf_checkpoint(arch)
    native = run_on(OUR_TIERS[0], monkeypatch, path, expert_dtype)
    for name in OUR_TIERS[1:]:
        assert all(torch.equal(a, b) for a, b in zip(run_on(name, monkeypatch, path, expert_dtype), native)), name


def test_every_tier_gives_the_native_tiers_int4_logits(bf16_checkpoint, monkeypatch):
    native = run_on(OUR_TIERS[0], monkeypatch, bf16_checkpoint, "int4")
    for name in OUR_TIERS[1:]:
        assert all(torch.equal(a, b) for a, b in zip(run_on(name, monkeypatch, bf16_checkpoint, "int4"), native)), name


def generate(tier: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`moepager generate` in a process of its own on `tier`, greedy, 24 tokens."""
    env = {**os.environ, "MOEPAGER_CPU_TIER": tier, **(env or {})}
    return subprocess.run([sys.executable, "-m", "moepager.cli.main", "generate", "--temperature", "0", "--max-tokens",
                           "24", "--quiet", *args], env=env, capture_output=True, text=True, timeout=600)


def split_output(out: str) -> tuple[str, str]:
    """generate's output: the text, then the statistics table (from its first row, "prompts")."""
    text, stats = out.split("\nprompts ", 1)
    return text, "prompts " + stats


def test_the_readme_job_prints_the_same_text_on_every_tier_and_names_it():
    """The built-in model, greedy: every tier's text (bf16, int8, int4) is the native tier's, and the run's statistics
    name the tier; int8 and int4 keep the bf16 text's first words (their activations and weights are quantized)."""
    texts = {}
    for name in OUR_TIERS:
        for dtype in ("bf16", "int8", "int4"):
            run = generate(name, "--expert-dtype", dtype, "The history of")
            assert run.returncode == 0, run.stderr
            text, stats = split_output(run.stdout)
            assert f"CPU kernels       {name}" in stats
            texts[name, dtype] = text
    for dtype in ("bf16", "int8", "int4"):
        assert len({texts[name, dtype] for name in OUR_TIERS}) == 1, dtype
    bf16 = texts[OUR_TIERS[0], "bf16"]
    for dtype in ("int8", "int4"):
        assert texts[OUR_TIERS[0], dtype][:28] == bf16[:28] and texts[OUR_TIERS[0], dtype] != "", (dtype, bf16)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="emulates an x86 host without AVX-512")
def test_an_avx2_host_as_torch_sees_it_runs_the_readme_job_the_compiled_step_and_calibrate(tmp_path):
    """This host as an AVX2-only CPU looks to torch (its kernels at AVX2, oneDNN capped at AVX2, so that its bf16
    prepack raises as on AMD Zen 3) and to moepager (the avx2 tier): the README's job, int4 experts from torch's
    int4pack layout (moepager's kernels off), `--compile` and `calibrate` run, the texts are the AVX-512 host's, and the
    `packed` expert kernel (oneDNN's bf16 prepack) is refused in one line."""
    if "avx2" not in OUR_TIERS:
        pytest.skip("this CPU has no AVX2")
    # (Inductor's cache of compiled steps is keyed without torch's CPU capability: one of its own here, so neither
    # this run nor a later native one loads the other's compiled code, which aborts the process)
    avx2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
            "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    runs = {
        "readme": generate("avx2", "The history of", env=avx2),
        "int4 on torch": generate("torch", "--expert-dtype", "int4", "The history of", env=avx2),
        "compile": generate("avx2", "--compile", "The history of", env=avx2),
    }
    packed = generate("avx2", "--expert-kernel", "packed", "The history of", env=avx2)  # oneDNN's bf16: AVX-512 only
    refused = "error: the 'packed' expert kernel cannot run here (mkldnn_reorder_linear_weight: bf16 path needs"
    assert packed.returncode == 2 and packed.stderr.splitlines()[-1].startswith(refused), packed.stderr
    for what, run in runs.items():
        assert run.returncode == 0, (what, run.stderr)
        assert "Traceback" not in run.stderr, (what, run.stderr)
    native = generate(OUR_TIERS[0], "The history of")
    assert split_output(runs["readme"].stdout)[0] == split_output(native.stdout)[0]
    assert runs["int4 on torch"].stdout.startswith("The history of the")  # not "The history ofMRMRMR..."
    profile = tmp_path / "profile.json"
    calibrate = subprocess.run([sys.executable, "-m", "moepager.cli.main", "calibrate", "--out", str(profile),
                                "--prefill-tokens", "16", "--quiet"],
                               env={**os.environ, **avx2, "MOEPAGER_CPU_TIER": "avx2"}, capture_output=True, text=True,
                               timeout=600)
    assert calibrate.returncode == 0 and profile.exists(), calibrate.stderr


@pytest.mark.parametrize("capability", ["avx512", "avx2", "default"])
def test_the_int4pack_layout_is_found_for_whatever_kernel_torch_runs(capability):
    """torch's int4pack layout depends on the CPU kernel torch dispatches to (AVX512, AVX2, DEFAULT): moepager's fast
    packing matches the op's under each this CPU can run."""
    if capability == "avx512" and "avx512-bf16" not in OUR_TIERS and "avx512f" not in cpu_tiers.cpu_features():
        pytest.skip("this CPU has no AVX-512")
    code = ("import torch\nfrom moepager.experts.quant import int4pack_layout, pack_int4_cpu, pack_nibbles\n"
            "assert int4pack_layout() is not None\n"
            "for n, k in ((128, 64), (192, 96), (704, 256), (96, 64)):\n"
            "    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)\n"
            "    want = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)\n"
            "    assert torch.equal(pack_int4_cpu(pack_nibbles(q)), want), (n, k)\n"
            "print(torch.backends.cpu.get_cpu_capability(), int4pack_layout())\n")
    run = subprocess.run([sys.executable, "-c", code], env={**os.environ, "ATEN_CPU_CAPABILITY": capability},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(capability.upper())


# ---- the torch-free harness --------------------------------------------------------------------------------------


def build_harness(tier: cpu_tiers.Tier, out: Path, compiler: str = "g++", machine: str | None = None,
                  static: bool = False) -> Path:
    """csrc/harness.cpp built for `tier` with the extension's own flags (cpu_kernels.BASE_FLAGS)."""
    exe = out / f"harness-{tier.name}-{machine or platform.machine()}"
    cmd = [compiler, *cpu_kernels.BASE_FLAGS, *cpu_tiers.flags_for(tier, machine), f"-DMOEPAGER_TIER_{tier.macro}",
           *(["-static"] if static else []), str(CSRC / "harness.cpp"), "-o", str(exe)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return exe


def harness_lines(cmd: list[str]) -> list[str]:
    run = subprocess.run([*cmd, "--threads", "3"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    first, *lines = run.stdout.splitlines()
    assert first.startswith("tier ") and len(lines) >= 20
    return lines


@pytest.fixture(scope="module")
def portable_lines(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("no g++")
    return harness_lines([str(build_harness(cpu_tiers.BY_NAME["portable"], tmp_path_factory.mktemp("harness")))])


def test_every_tier_here_prints_the_portable_tiers_harness_lines(tmp_path, portable_lines):
    """Every kernel on fixed inputs, torch-free: each tier this CPU runs gives the portable tier's bits, at 1 and at 3
    threads (the harness fails a case whose bits change with the thread count)."""
    for name in OUR_TIERS:
        if name != "portable":
            assert harness_lines([str(build_harness(cpu_tiers.BY_NAME[name], tmp_path))]) == portable_lines, name


@pytest.mark.emulated
@pytest.mark.parametrize("name", ["neon-dotprod", "neon", "portable"])
def test_the_arm64_tiers_built_for_arm64_print_the_portable_tiers_lines_under_qemu(tmp_path, portable_lines, name):
    """Cross-compiled with Debian's g++-aarch64-linux-gnu (static) and run under qemu-aarch64: NEON with and without
    the dot-product extension (`-cpu max` has it; `-cpu cortex-a53` lacks it, and the plain neon build must run
    there), and the portable tier on ARM64."""
    compiler, qemu = shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64")
    if compiler is None or qemu is None:
        pytest.fail("needs g++-aarch64-linux-gnu and qemu-user (apt-get install g++-aarch64-linux-gnu qemu-user)")
    exe = build_harness(cpu_tiers.BY_NAME[name], tmp_path, compiler, "aarch64", static=True)
    cpu = "max" if name == "neon-dotprod" else "cortex-a53"
    assert harness_lines([qemu, "-cpu", cpu, str(exe)]) == portable_lines


@pytest.mark.emulated
def test_the_avx2_tier_runs_on_a_cpu_without_avx512(tmp_path, portable_lines):
    """The avx2 build under qemu-x86_64 emulating a Haswell (AVX2, FMA, F16C; no AVX-512): it runs (an AVX-512
    instruction would end it with SIGILL, as it ends the avx512-bf16 build) and prints the portable tier's lines."""
    qemu = shutil.which("qemu-x86_64")
    if platform.machine() != "x86_64":
        pytest.skip("an x86 check")
    if qemu is None:
        pytest.fail("needs qemu-user (apt-get install qemu-user)")
    exe = build_harness(cpu_tiers.BY_NAME["avx2"], tmp_path)
    assert harness_lines([qemu, "-cpu", "Haswell", str(exe)]) == portable_lines
    wide = build_harness(cpu_tiers.BY_NAME["avx512-bf16"], tmp_path)
    assert subprocess.run([qemu, "-cpu", "Haswell", str(wide)], capture_output=True).returncode == -signal.SIGILL


def test_the_server_answers_the_same_text_on_every_tier():
    """`moepager serve` on each tier (MOEPAGER_CPU_TIER in its environment): a greedy completion from the official
    client is the native tier's text, and /v1/stats names the tier."""
    openai = pytest.importorskip("openai")
    from tests.cli.test_serve import wait_healthy
    from tests.server.conftest import free_port

    texts = {}
    for name in OUR_TIERS:
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "moepager.cli.main", "serve", "--port", str(port), "--quiet"],
                                env={**os.environ, "MOEPAGER_CPU_TIER": name}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, proc)
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=60, max_retries=0)
            texts[name] = client.completions.create(model="demo-moe", prompt="The history of", max_tokens=16,
                                                    temperature=0).choices[0].text
            assert httpx.get(f"{url}/v1/stats").json()["cpu_kernels"] == name
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=30)
    assert len(set(texts.values())) == 1 and texts[OUR_TIERS[0]].strip(), texts
