"""The automatic fit (placements/fit.py): with no expert budget a run sizes its expert cache to the memory it may use,
pages the rest from disk with the same tokens, refuses with the numbers what cannot fit, and reads a container's
cgroup limit."""

from __future__ import annotations

import psutil
import pytest

from moepager.checkpoints.default import default_model_path
from moepager.cli.info import describe
from moepager.config import EngineConfig, PlacementConfig, PrefetchConfig, SchedulerConfig, StoreConfig
from moepager.errors import BudgetError, MoepagerError
from moepager.loading.build import LoadOptions, open_checkpoint
from moepager.placements.fit import HEADROOM_MIN, fit_of, fitted
from moepager.runtime.llm import LLM
from moepager.runtime.sampling import SamplingParams
from moepager.store.budget import ENV_AVAILABLE, cgroup_room, format_bytes

MiB = 1 << 20
"""The built-in model: 6.35 MiB of dense weights, 48.05 MiB of KV cache at the default 16,384 positions, 178 MiB of
a 512-token step's working memory (one attention call's scores over all 16,384 positions, most of it), 18 MiB of
experts (192 of 96 KiB)."""


def opened():
    return open_checkpoint(default_model_path(), LoadOptions.of(EngineConfig()))


def test_plenty_of_memory_keeps_every_expert_resident(monkeypatch):
    monkeypatch.setenv(ENV_AVAILABLE, "64GiB")
    config = EngineConfig()
    fit = fit_of(config, opened())
    assert fit.resident and fit.budget is None and fit.headroom == int(0.1 * (64 << 30))
    assert fitted(config, opened()) == (config, fit.describe())
    assert fit.describe().startswith("fit: every routed expert resident")


def test_a_tight_machine_pages_the_experts_and_gives_the_resident_tokens(monkeypatch):
    config = EngineConfig()
    params = SamplingParams(max_tokens=12, temperature=0)
    resident = LLM(config=config, show_progress=False)
    assert resident.store is None
    want = resident.generate(["The history of"], params)[0].token_ids
    monkeypatch.setenv(ENV_AVAILABLE, "490MiB")
    fit = fit_of(config, opened())
    assert not fit.resident
    assert fit.budget == 490 * MiB - fit.dense - fit.kv - fit.working - HEADROOM_MIN  # a tenth is below the least
    assert fit.least < fit.budget < fit.experts
    tight = fitted(config, opened())[0]
    assert tight.store.expert_memory == str(fit.budget) and tight.store.paged
    llm = LLM(config=config, show_progress=False)
    assert llm.store is not None and "fit: --expert-memory" in llm.loaded.execution
    assert llm.store.device.table.capacity + len(llm.store.device.table.stream_rows) < 192  # not every expert
    assert llm.generate(["The history of"], params)[0].token_ids == want  # lossless
    assert "fit on this machine" in dict(describe(str(default_model_path())))
    assert f"--expert-memory {format_bytes(fit.budget)}" in dict(describe(str(default_model_path())))[
        "fit on this machine"]
    assert format_bytes(fit.working) == "178.00 MiB"


def test_a_machine_too_small_is_refused_before_loading_with_the_numbers(monkeypatch):
    monkeypatch.setenv(ENV_AVAILABLE, "300MiB")
    with pytest.raises(BudgetError, match=r"does not fit here: 300.00 MiB RAM .* 48.05 MiB of KV cache, 178.00 MiB "
                                          r"of a step.s .* lower "
                                          r"--kv-cache-tokens"):
        LLM(config=EngineConfig(), show_progress=False)
    monkeypatch.setenv(ENV_AVAILABLE, "320MiB")  # a KV cache larger than the machine: its own check says so
    with pytest.raises(BudgetError, match="--kv-cache-tokens 1000000: the KV cache would take"):
        LLM(config=EngineConfig(scheduler=SchedulerConfig(kv_cache_tokens=10**6)), show_progress=False)
    monkeypatch.setenv(ENV_AVAILABLE, "25%")
    with pytest.raises(BudgetError, match="must be a size"):
        fit_of(EngineConfig(), opened())


def test_a_fitted_run_takes_a_predictor_and_paging_options_and_prefetches_when_it_pages(monkeypatch, capsys):
    """No --expert-memory: the fit decides whether experts page, so --predictor and the store's options are taken
    where it pages (the prefetcher built, the resident run's tokens), and said unused where it keeps them all."""
    params = SamplingParams(max_tokens=12, temperature=0)
    want = LLM(config=EngineConfig(), show_progress=False).generate(["The history of"], params)[0].token_ids
    config = EngineConfig(store=StoreConfig(policy="lfu", io_threads=2),
                          prefetch=PrefetchConfig(predictor="gate-lookahead"))
    assert config.fit_decides
    monkeypatch.setenv(ENV_AVAILABLE, "64GiB")
    plenty = LLM(config=config, show_progress=False)
    assert plenty.store is None and plenty.prefetcher is None
    assert plenty.loaded.execution.endswith("; --predictor gate-lookahead, --policy, --io-threads unused: nothing is "
                                            "paged")
    assert "unused: nothing is paged" in capsys.readouterr().err
    assert plenty.generate(["The history of"], params)[0].token_ids == want
    monkeypatch.setenv(ENV_AVAILABLE, "490MiB")
    tight = LLM(config=config, show_progress=False)
    assert tight.store is not None and tight.prefetcher is not None and "unused" not in tight.loaded.execution
    assert tight.config.store.policy == "lfu" and tight.config.store.io_threads == 2
    assert tight.generate(["The history of"], params)[0].token_ids == want  # lossless
    assert tight.last_stats.sections["experts"].to_dict()["decode"]["loads_ahead"] > 0
    with pytest.raises(MoepagerError, match="prefetching needs a paged store"):  # a run that is never fitted
        EngineConfig(store=StoreConfig(expert_memory=None), prefetch=PrefetchConfig(predictor="gate-lookahead"),
                     placement=PlacementConfig(execution="cpu-experts"))


def test_a_given_budget_or_workers_are_never_fitted():
    assert EngineConfig().fit_decides
    assert not EngineConfig(store=StoreConfig(expert_memory="all")).fit_decides
    assert not EngineConfig(store=StoreConfig(expert_memory="25%")).fit_decides


def test_the_cgroup_limit_less_its_usage_bounds_the_fit(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("0::/user.slice/run\n")
    group = tmp_path / "fs" / "user.slice" / "run"
    group.mkdir(parents=True)
    (group / "memory.max").write_text("4294967296\n")
    (group / "memory.current").write_text("1073741824\n")
    assert cgroup_room(tmp_path / "fs", proc) == 3 << 30
    (group / "memory.max").write_text("max\n")
    assert cgroup_room(tmp_path / "fs", proc) is None
    proc.write_text("12:cpu,cpuacct:/x\n9:memory:/docker/abc\n")  # cgroup v1
    v1 = tmp_path / "fs" / "memory" / "docker" / "abc"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(str(2 << 30))
    (v1 / "memory.usage_in_bytes").write_text(str(512 << 20))
    assert cgroup_room(tmp_path / "fs", proc) == (2 << 30) - (512 << 20)
    (v1 / "memory.limit_in_bytes").write_text(str(9223372036854771712))  # v1's "no limit"
    assert cgroup_room(tmp_path / "fs", proc) is None
    assert cgroup_room(tmp_path / "fs", tmp_path / "absent") is None


def test_a_fit_paging_from_disk_chunks_prompts_as_the_cost_model_says(monkeypatch):
    """Each prompt chunk reads its layers' missing experts once: slow reads against fast compute give larger chunks,
    as far as their working memory allows; reads that compute covers keep the default; a user's chunk is kept."""
    from dataclasses import replace

    from moepager.experts.hybrid import ExpertTimes
    from moepager.placements.fit import CHUNK_MEMORY_SHARE, prefill_chunk, step_bytes

    monkeypatch.setenv(ENV_AVAILABLE, "2GiB")
    config, o = EngineConfig(), opened()
    fit = replace(fit_of(config, o), available=490 * MiB)  # pages: ~9.6 MiB of the 18 MiB of experts
    assert fit.budget is not None
    slow_disk = ExpertTimes(1e-4, 1e-6, 1e-4, 1e-6, copy_s=1.0)
    fast_disk = ExpertTimes(1e-4, 1e-6, 1e-4, 1e-6, copy_s=1e-9)
    assert prefill_chunk(fit, o, config, fast_disk) == 512  # the default chunk's compute already covers its reads
    roomy = replace(fit, available=64 << 30, experts=128 << 30)  # a big budget, still paging
    assert prefill_chunk(roomy, o, config, slow_disk) == 4096
    chosen = prefill_chunk(fit, o, config, slow_disk)  # a small budget: its working memory caps the chunk
    assert chosen == 512 and step_bytes(o, 1024, 16384, 16) > fit.budget // CHUNK_MEMORY_SHARE
    monkeypatch.setenv(ENV_AVAILABLE, "490MiB")
    tuned, line = fitted(config, o, slow_disk)
    assert tuned.scheduler.max_batched_tokens == chosen and (chosen == 512 or "prompts in chunks of" in line)
    mine = EngineConfig(scheduler=SchedulerConfig(max_batched_tokens=256))
    assert fitted(mine, o, slow_disk)[0].scheduler.max_batched_tokens == 256


def test_the_run_uses_the_chunk_its_fit_chose(monkeypatch):
    """The scheduler reads the configuration as built (the fit's budget and prompt chunk), not the one given."""
    import moepager.placements.fit as fit_module

    params = SamplingParams(max_tokens=4, temperature=0)
    prompt = "The history of " * 200  # a prompt of more than 512 tokens
    want = LLM(show_progress=False).generate([prompt], params)[0].token_ids
    monkeypatch.setenv(ENV_AVAILABLE, "400MiB")
    monkeypatch.setattr(fit_module, "prefill_chunk", lambda *args: 1024)
    monkeypatch.setattr(fit_module, "step_bytes", lambda *args: 80 * MiB)  # pages, at either chunk
    llm = LLM(config=EngineConfig(), show_progress=False)
    assert llm.config.scheduler.max_batched_tokens == 1024 and llm.config.store.expert_memory is not None
    assert "prompts in chunks of 1024 tokens" in llm.loaded.execution
    out = llm.generate([prompt], params)[0]
    assert len(llm.tokenizer.encode(prompt)) > 512 and out.token_ids == want


def test_the_libraries_mapped_here_are_taken_from_the_memory_a_run_may_use(tmp_path, monkeypatch):
    """Their pages count in the process's RSS but not in what the machine or a cgroup says is used (bigger_than_ram's
    peak RSS passed the limit less the headroom by about their size): the fit takes them off what it may use."""
    from moepager.store import budget

    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmRSS:\t  291388 kB\nVmLib:\t  400304 kB\nVmPTE:\t     756 kB\n")
    assert budget.mapped_libraries(status) == 400304 * 1024
    assert budget.mapped_libraries(tmp_path / "absent") == 0
    monkeypatch.delenv(ENV_AVAILABLE, raising=False)
    monkeypatch.setattr(budget, "mapped_libraries", lambda: 400 * MiB)
    monkeypatch.setattr(budget, "cgroup_room", lambda: 8 << 30)
    assert budget.ram_available() == ((8 << 30) - 400 * MiB, "(the cgroup's memory limit less its usage less "
                                                               "400.00 MiB of shared libraries mapped here)")
    monkeypatch.setattr(budget, "cgroup_room", lambda: None)
    available, source = budget.ram_available()
    assert source == "available less 400.00 MiB of shared libraries mapped here"
    assert 0 <= available <= psutil.virtual_memory().available - 400 * MiB + 64 * MiB  # (what others freed since)
    monkeypatch.undo()
    assert budget.mapped_libraries() > 0  # this process's own: torch's libraries are mapped


def test_a_fit_paging_from_disk_measures_the_disk_and_says_a_slow_one(monkeypatch):
    """A run paging from disk times random experts' reads through its reader and says what a decode token waits on
    the disk; below SLOW_DISK_BPS the line says the disk is slow and what reads less. The run goes on either way."""
    import moepager.placements.fit as fit_module

    monkeypatch.setenv(ENV_AVAILABLE, "490MiB")
    config, o = EngineConfig(), opened()
    fit = fit_of(config, o)
    assert fit.budget is not None
    missing = o.paging.num_moe_layers * o.paging.top_k * (1 - fit.budget / fit.experts) * o.reader.shape.nbytes
    monkeypatch.setattr(fit_module, "disk_rate", lambda opened, io_threads: 2e9)
    line = fitted(config, o)[1]
    assert f"; the disk reads 2.00 GB/s (random experts), so a decode token waits about " \
           f"{missing / 2e9 * 1e3:.0f} ms for its {format_bytes(missing)} of missing experts" in line
    assert "slow" not in line
    monkeypatch.setattr(fit_module, "disk_rate", lambda opened, io_threads: 1e6)
    slow = fitted(config, o)[1]
    assert f"; slow disk: the disk reads 0.00 GB/s (random experts), so a decode token waits about " \
           f"{missing / 1e6:.2f} s" in slow and "below 0.25 GB/s; a faster disk for the checkpoint" in slow
    llm = LLM(config=config, show_progress=False)  # a slow disk is said, not refused
    assert "slow disk" in llm.loaded.execution and llm.store is not None
    monkeypatch.setenv(ENV_AVAILABLE, "64GiB")
    calls = []
    monkeypatch.setattr(fit_module, "disk_rate", lambda *args: calls.append(args) or 1e6)
    assert "disk" not in fitted(config, opened())[1] and calls == []  # nothing paged: nothing read


def test_the_disk_probe_reads_random_experts_bounded_in_count_bytes_and_time():
    """At least PROBE_READS reads and PROBE_BYTES, several experts of several layers, and no read started past its
    time but each thread's first."""
    from moepager.placements.fit import PROBE_BYTES, PROBE_READS, disk_rate

    o = opened()
    read, seen = o.reader.read, []

    def counting(key, out, between=None):
        seen.append(key)
        return read(key, out, between)

    o.reader.read = counting
    assert disk_rate(o, io_threads=4, seconds=60.0) > 0
    nbytes = o.reader.shape.nbytes
    assert len(seen) == max(PROBE_READS, -(-PROBE_BYTES // nbytes)) and len(seen) * nbytes >= PROBE_BYTES
    assert len({k.layer for k in seen}) == o.paging.num_moe_layers and len(set(seen)) > 100
    seen.clear()
    assert disk_rate(o, io_threads=3, seconds=0.0) > 0 and len(seen) == 3
