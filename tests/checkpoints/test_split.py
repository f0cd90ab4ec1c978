"""Split experts (`moepager split`, MoEpic's vertical split): the same model summed in another order, paged with its
top parts cached and its bottom parts streamed, bit for bit the resident split run at every budget and ratio.

Tolerance of a split checkpoint against its original (the summation order changes; measured on these fixtures):
fp32 logits within 1e-6 (seen: 7e-8), bf16 within 2e-2 (seen: 0), the greedy tokens the same; int8 and int4 parts are
quantized with scales of their own: see `test_quantized_split_experts_lose_no_more_than_the_quantized_unsplit_ones`."""

from __future__ import annotations

import json

import pytest
import torch

from moepager.checkpoints.default import default_model_path
from moepager.checkpoints.disk import bounce_bytes
from moepager.checkpoints.quantized import quantize_checkpoint
from moepager.checkpoints.split import split_checkpoint
from moepager.cli.main import main
from moepager.config import EngineConfig, PlacementConfig, PrefetchConfig, StoreConfig
from moepager.errors import BudgetError, ConfigError
from moepager.models.attention import ForwardBatch
from moepager.placements.paged import paged_executor
from moepager.policies import ENGINE_POLICIES
from moepager.runtime.builder import load_model
from moepager.runtime.llm import LLM
from moepager.runtime.replay import ReplaySpec
from moepager.runtime.sampling import SamplingParams
from moepager.store.budget import format_bytes
from moepager.trace.simulate import SimSpec
from moepager.trace.split import simulate_split
from moepager.trace.workload import Cut, load_workload
from tests.conftest import ARCHS, VOCAB
from tests.runtime.test_offload import logits_run
from tests.trace.conftest import random_trace
from tests.trace.test_agreement import assert_same_hits_and_misses

CPU = torch.device("cpu")
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def split_olmoe(hf_checkpoint, tmp_path_factory):
    _, path = hf_checkpoint("olmoe")
    return path, split_checkpoint(path, tmp_path_factory.mktemp("split") / "olmoe4", 4, show_progress=False)


def assert_agree(got: list[torch.Tensor], ref: list[torch.Tensor], atol: float) -> None:
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=0)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("arch", ARCHS)
def test_a_split_checkpoint_is_the_unsplit_model_to_rounding_on_every_architecture(hf_checkpoint, arch, tmp_path):
    _, path = hf_checkpoint(arch)
    for parts in (2, 4):
        split = split_checkpoint(path, tmp_path / f"s{parts}", parts, show_progress=False)
        for dtype in (torch.float32, torch.bfloat16):
            ref = logits_run(load_model(path, dtype=dtype, show_progress=False))
            got = logits_run(load_model(split, dtype=dtype, show_progress=False))
            assert_agree(got, ref, TOLERANCE[dtype])


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_split_experts_lose_no_more_than_the_quantized_unsplit_ones(tmp_path, fmt):
    """The built-in model (bf16; its 64-wide experts in 2 parts of 32, one int4 group): each part is quantized with
    scales of its own (int8's per output channel then cover half a row), so the split quantized run is no farther
    from the float run than the unsplit quantized one (RMS over the logits, within 10%; seen: int8 0.057 against
    0.079, int4 0.165 against 0.165), and picks the same greedy tokens."""
    split = split_checkpoint(default_model_path(), tmp_path / "s2", 2, show_progress=False)
    ref = logits_run(load_model(default_model_path(), show_progress=False))
    unsplit = logits_run(load_model(default_model_path(), expert_dtype=fmt, show_progress=False))
    got = logits_run(load_model(split, expert_dtype=fmt, show_progress=False))

    def rms(run: list[torch.Tensor]) -> float:
        return sum((a.float() - b.float()).pow(2).mean().item() for a, b in zip(run, ref)) ** 0.5

    assert 0 < rms(got) <= 1.1 * rms(unsplit)
    assert all(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(got, unsplit))


def part_budget(part_bytes: int, parts: int) -> str:
    """An --expert-memory of `parts` parts (cached and streaming) beside the read buffers (4 I/O threads and the
    prefetch lane's one)."""
    return str(parts * part_bytes + 5 * bounce_bytes(part_bytes))


def plan_file(tmp_path, budgets, theta) -> str:
    path = tmp_path / f"plan-{len(list(tmp_path.iterdir()))}.json"
    path.write_text(json.dumps({"budgets": budgets, "theta": theta}))
    return str(path)


@pytest.mark.parametrize("host_tier", [False, True], ids=["disk", "host"])
def test_paged_split_experts_give_the_resident_split_logits_bit_for_bit(split_olmoe, tmp_path, host_tier):
    """Every split ratio (one part of four cached up to all four, uneven between layers) and budgets from the least
    (each layer's top-2 experts' parts beside the streaming bottoms) to most of the experts."""
    _, split = split_olmoe
    ref = logits_run(load_model(split, show_progress=False))
    part_bytes = load_model(split, show_progress=False).expert_shape.nbytes
    for theta in ([0.25] * 3, [0.5] * 3, [1.0] * 3, [0.25, 1.0, 0.5]):
        for experts in (8, 14, 20):  # whole experts' bytes (2 x 3 layers = 6 the least cached, 24 in all)
            for warm in (False, True):
                budget = part_budget(part_bytes, experts * 4)
                store = StoreConfig(expert_memory=budget, warm=warm, policy="lru",
                                    layer_plan=plan_file(tmp_path, [1.0, 1.0, 1.0], theta))
                paged = load_model(split, executor_factory=paged_executor(store, CPU, host_tier=host_tier),
                                   show_progress=False)
                got = logits_run(paged)
                assert all(torch.equal(a, b) for a, b in zip(got, ref)), (theta, experts, warm)
                s = paged.experts.inner.store
                tops = [round(t * 4) for t in theta]
                assert all(k.expert % 4 < tops[i] for i, layer in enumerate(s.layers()) for k in
                           s.device.table.by_layer[layer])  # no bottom part is ever cached
                assert len(s.device.table.stream_rows) >= 2 * (4 - min(tops))  # a decode's bottoms load at once
                s.close()


@pytest.mark.parametrize("policy", ENGINE_POLICIES)
def test_every_policy_and_the_global_scope_page_split_experts_losslessly(split_olmoe, tmp_path, policy):
    _, split = split_olmoe
    ref = logits_run(load_model(split, show_progress=False), steps=6)
    part_bytes = load_model(split, show_progress=False).expert_shape.nbytes
    for scope in ("layer", "global"):
        plan = plan_file(tmp_path, [1.0, 2.0, 1.0], [0.5, 0.75, 0.25]) if scope == "layer" else None
        store = StoreConfig(expert_memory=part_budget(part_bytes, 10 * 4), policy=policy, scope=scope,
                            layer_plan=plan, warm=scope == "layer")
        paged = load_model(split, executor_factory=paged_executor(store, CPU), show_progress=False)
        assert all(torch.equal(a, b) for a, b in zip(logits_run(paged, steps=6), ref)), scope
        paged.experts.inner.store.close()


def test_the_engine_on_split_experts_agrees_with_the_simulator_part_for_part(split_olmoe, tmp_path):
    """Uneven budgets and split ratios: the store's hits and misses per layer and phase (counted in parts, bottoms
    always missing) equal `simulate_split`'s on the trace the engine replays."""
    _, split = split_olmoe
    trace = random_trace(tmp_path / "t.mpt", lengths=(12, 9, 15), prefill=15, seed=2)
    part_bytes = load_model(split, show_progress=False).expert_shape.nbytes
    theta = [0.5, 0.25, 1.0]
    for warm in (False, True):
        store = StoreConfig(expert_memory=part_budget(part_bytes, 12 * 4), policy="lru", warm=warm,
                            layer_plan=plan_file(tmp_path, [1.0, 3.0, 2.0], theta))
        llm = LLM(split, store=store, show_progress=False)
        s = llm.loaded.experts.inner.store
        quotas = list(s.device.table.quota.values())
        llm.replay(ReplaySpec(trace, prompt_tokens=2))
        work = load_workload(str(trace), "recorded", cut=Cut(prompt_tokens=2))
        sim = simulate_split(work, SimSpec("lru", max(quotas), per_layer=tuple(quotas), warm=warm), 4,
                             [round(t * 4) for t in theta])
        assert_same_hits_and_misses(s.counters.phases, sim, llm.loaded.config.moe_layers)
        assert "split" in llm.last_stats.table()


def test_a_reconfiguration_between_steps_changes_no_logit(split_olmoe, tmp_path):
    """Budgets and split ratios changed twice in the middle of a generation (a layer shrinking below what it holds, a
    ratio falling so cached parts become bottoms): the logits stay the resident run's, bit for bit."""
    _, split = split_olmoe
    ref = logits_run(load_model(split, show_progress=False), steps=6)
    part_bytes = load_model(split, show_progress=False).expert_shape.nbytes
    store = StoreConfig(expert_memory=part_budget(part_bytes, 14 * 4), policy="lru",
                        layer_plan=plan_file(tmp_path, [1.0, 1.0, 1.0], [0.5, 0.5, 0.5]))
    paged = load_model(split, executor_factory=paged_executor(store, CPU), show_progress=False)
    s = paged.experts.inner.store
    layers, capacity = s.layers(), s.device.table.capacity
    changes = {2: ({layers[0]: 8, layers[1]: capacity - 16, layers[2]: 8}, None),
               4: ({layers[0]: capacity - 16, layers[1]: 8, layers[2]: 8}, dict(zip(layers, (1, 2, 2))))}
    got = run_with_changes(paged, changes, steps=6)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert list(s.device.table.quota.values()) == [capacity - 16, 8, 8]
    assert all(k.expert % 4 < 1 for k in s.device.table.by_layer[layers[0]])
    assert all(len(s.device.table.by_layer[layer]) <= s.device.table.quota[layer] for layer in layers)


def run_with_changes(loaded, changes, steps: int) -> list[torch.Tensor]:
    """`logits_run` on one prompt, calling the store's `reconfigure(*changes[step])` before those decode steps."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, 13), generator=gen)[:2]
    lens = torch.tensor([13, 9])
    pos = torch.arange(13).expand(2, 13)
    cache = loaded.model.make_cache(2, 13 + steps, loaded.dtype, CPU)
    out, store = [], loaded.experts.inner.store
    with torch.inference_mode():
        logits = loaded.model(ids, ForwardBatch.build(pos, valid_BT=pos < lens[:, None]), cache, logits_at_B=lens - 1)
        out.append(logits)
        for step in range(steps):
            if step in changes:
                store.reconfigure(*changes[step])
            nxt = logits.argmax(-1, keepdim=True)
            logits = loaded.model(nxt, ForwardBatch.build((lens + step)[:, None]), cache,
                                  logits_at_B=torch.zeros(2, dtype=torch.long))
            out.append(logits)
    return out


def test_splitting_is_checked(split_olmoe, hf_checkpoint, tmp_path):
    path, split = split_olmoe
    with pytest.raises(ConfigError, match="split already"):
        split_checkpoint(split, tmp_path / "again", 2, show_progress=False)
    with pytest.raises(ConfigError, match="--parts must be one of 2, 4, 8"):
        split_checkpoint(path, tmp_path / "three", 3, show_progress=False)
    _, mixtral = hf_checkpoint("mixtral")  # intermediate 24: not in 16 parts, and 8 parts of 3 are fine
    quantized = quantize_checkpoint(mixtral, tmp_path / "q", "int8", show_progress=False)
    with pytest.raises(ConfigError, match="holds quantized experts; split its float original"):
        split_checkpoint(quantized, tmp_path / "qs", 2, show_progress=False)
    assert not (tmp_path / "qs").exists()
    with pytest.raises(ConfigError, match="stores its experts in parts"):  # and a split copy is not quantized
        quantize_checkpoint(split, tmp_path / "sq", "int8", show_progress=False)


@pytest.mark.parametrize("theta, policy", [([1.0] * 3, "lru"), ([0.5, 0.75, 0.25], "lru"), ([0.5] * 3, "fmoe")])
def test_a_predictor_prefetches_split_experts_tops_and_bottoms_without_changing_a_token(split_olmoe, tmp_path, theta,
                                                                                      policy):
    """MoEpic's prefetch of the next layer's predicted experts on a split checkpoint (store/parts.py): gate lookahead
    forecasts whole experts, their cacheable (top) parts load ahead into the cache and their bottoms into the free
    stream rows, from which a routed layer computes them (never cached); the greedy tokens are the resident split
    run's, and loads ahead happen and are judged. fMoE ranks evictions by the forecasts, per part."""
    _, split = split_olmoe
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[3, 11, 5, 7, 9, 2], [7, 1, 2]]
    reference = [c.token_ids for c in LLM(split, show_progress=False).generate(prompts, params)]
    part_bytes = load_model(split, show_progress=False).expert_shape.nbytes
    store = StoreConfig(expert_memory=part_budget(part_bytes, 12 * 4), policy=policy, warm=False, direct_io="off",
                        layer_plan=plan_file(tmp_path, [1.0, 1.0, 1.0], theta))
    llm = LLM(config=EngineConfig(model=str(split), store=store, prefetch=PrefetchConfig("gate-lookahead")),
              show_progress=False)
    s = llm.loaded.experts.inner.store
    from_rows = []
    computed_from_rows = s.buffer.take

    def counted(held, keys, wanted):  # the bottoms a layer found loaded ahead in stream rows
        rest = computed_from_rows(held, keys, wanted)
        from_rows.append(len(wanted) - len(rest))
        return rest
    s.buffer.take = counted
    assert [c.token_ids for c in llm.generate(prompts, params)] == reference
    phases = llm.last_stats.sections["experts"].phases.values()
    ahead = sum(p["loads_ahead"] for p in phases)
    judged = sum(p["prefetch_used"] + p["prefetch_wasted"] + p["prefetch_cancelled"] for p in phases)
    assert ahead > 0 and 0 < judged <= ahead
    assert (sum(from_rows) > 0) == (min(theta) < 1)  # bottoms loaded ahead were computed from their rows
    tops = [round(t * 4) for t in theta]
    assert all(k.expert % 4 < tops[i] for i, layer in enumerate(s.layers()) for k in s.device.table.by_layer[layer])


def test_split_runs_refuse_what_places_whole_experts_and_plans_need_a_split_checkpoint(split_olmoe, tmp_path):
    path, split = split_olmoe
    halves = plan_file(tmp_path, [1.0, 1.0, 1.0], [0.5, 0.5, 0.5])
    with pytest.raises(ConfigError, match="splits experts .* `moepager split"):
        LLM(path, store=StoreConfig(expert_memory="50%", layer_plan=halves), show_progress=False)
    with pytest.raises(ConfigError, match="stores its experts in 4 parts .* --execution cpu-experts place whole"):
        LLM(config=EngineConfig(model=str(split), placement=PlacementConfig(execution="cpu-experts")),
            show_progress=False)
    part_bytes = load_model(split, show_progress=False).expert_shape.nbytes
    least = 2 * 2 + 2 * 2  # a layer's top-2 experts' top halves, and a decode step's bottom halves streaming
    need = format_bytes(least * part_bytes + 5 * bounce_bytes(part_bytes))
    with pytest.raises(BudgetError, match=rf"holds 7 parts: split experts need .*\(4\) and 4 parts .* "
                                          rf"at least {need}"):
        LLM(split, store=StoreConfig(expert_memory=part_budget(part_bytes, least - 1), layer_plan=halves),
            show_progress=False)
    LLM(split, store=StoreConfig(expert_memory=part_budget(part_bytes, least), layer_plan=halves), show_progress=False)


def test_moepager_split_writes_a_checkpoint_that_generates(tmp_path, capsys):
    out = tmp_path / "demo-split"
    assert main(["split", "--parts", "2", "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["moepager_split"] == {"parts": 2} and (out / "tokenizer.json").is_file()
    plan = plan_file(tmp_path, [1.0] * 6, [0.5] * 6)
    prompt = ["--max-tokens", "8", "--temperature", "0", "Once upon a time"]
    assert main(["generate", "--model", str(out), "--expert-memory", "40%", "--layer-plan", plan, *prompt]) == 0
    split_text = capsys.readouterr().out
    assert main(["generate", *prompt]) == 0
    assert capsys.readouterr().out.splitlines()[0] == split_text.splitlines()[0]  # the same greedy text
    assert "split" in split_text
