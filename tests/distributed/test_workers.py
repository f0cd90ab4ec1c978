"""OD-MoE's worker processes (experts/remote/, distributed/): a main rank and 2-3 workers started by torchrun on
this machine (gloo, one thread each) give the single-process greedy tokens on every architecture; a worker that dies
or stops answering is named in an error within the timeout, and nothing hangs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from moepager.cli.launch import spawn_ranks
from moepager.config import WORKER_PREFILLS, EngineConfig, RemoteConfig
from moepager.errors import MoepagerError
from moepager.experts.remote.placement import Placement
from moepager.experts.remote.protocol import Place, decode
from moepager.runtime.llm import LLM
from moepager.runtime.sampling import SamplingParams
from tests.conftest import ARCHS
from tests.distributed.ranks import PROMPTS

TIMEOUT_S = 240


def torchrun(procs: int, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs), *args]
    environ = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=environ)


def ranks(tmp_path, procs: int, group: int, *paths: str, env: dict[str, str] | None = None) -> dict:
    """tests/distributed/ranks.py on `paths` under torchrun, every rank exiting cleanly; what rank 0 wrote, its tokens
    checked against the single process's."""
    out = tmp_path / "tokens.json"
    run = torchrun(procs, "tests/distributed/ranks.py", str(out), str(group), *paths, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(out.read_text())
    for path in paths:
        assert got[path] == single_process(path), path
    return got


def spawn(procs: int, *args: str, env: dict[str, str] | None = None) -> list[int]:
    """`procs` processes of a script as `generate --workers` starts them (each outliving the others); exit codes."""
    return spawn_ranks([sys.executable, *args], procs, 10, {"OMP_NUM_THREADS": "1", **(env or {})}, quiet=True,
                       main_timeout_s=TIMEOUT_S)


def single_process(path: str) -> list[list[int]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = LLM(config=EngineConfig(model=path, threads=1), show_progress=False)
        return [c.token_ids for c in llm.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True))]
    finally:
        torch.set_num_threads(threads)


def test_every_expert_lives_on_exactly_one_worker_and_layers_go_round_robin():
    p = Placement.of(4, 2)
    owners = {(layer, e): p.rank(layer, e) for layer in range(6) for e in range(8)}
    assert set(owners.values()) == {1, 2, 3, 4}
    assert {p.rank(0, e) for e in range(8)} == {1, 2} and {p.rank(1, e) for e in range(8)} == {3, 4}
    assert sum(len(p.owned(r, 6, 8)) for r in range(1, 5)) == 48
    with pytest.raises(MoepagerError):
        Placement.of(2, 3)
    left = p.without({2})  # a lost worker's experts go to the others: every expert still on exactly one of them
    assert left.ranks == (1, 3, 4) and left.group_size == 2
    assert {left.rank(layer, e) for layer in range(6) for e in range(8)} <= {1, 3, 4}


def test_one_to_one_gives_no_worker_more_than_its_share_of_a_call_and_keeps_experts_home_when_it_can():
    """OD-MoE's assignment: at most ceil(n / G) of a call's n experts on one worker of the layer's group (so at one
    token with G >= top-k, one each), an expert on its home worker unless its home is full; fixed puts every expert
    at home, and two with one home then share it."""
    generator = torch.Generator().manual_seed(0)
    for workers, group in ((4, 2), (6, 3), (8, 8), (5, 2)):
        p, fixed = Placement.of(workers, group), Placement.of(workers, group, "fixed")
        for _ in range(200):
            position = int(torch.randint(0, 6, (1,), generator=generator))
            n = int(torch.randint(1, 17, (1,), generator=generator))
            experts = sorted(torch.randperm(16, generator=generator)[:n].tolist())
            ranks = p.ranks_of(position, experts)
            share = -(-n // group)
            assert set(ranks) <= set(p.group(position))
            assert max(ranks.count(r) for r in ranks) == share
            homes = [p.rank(position, e) for e in experts]
            assert fixed.ranks_of(position, experts) == homes
            for r in set(homes):  # a home keeps min(share, its experts) of its own
                assert sum(h == r == a for h, a in zip(homes, ranks, strict=True)) == min(share, homes.count(r))
    p = Placement.of(2, 2)
    assert p.ranks_of(0, [1, 3]) == [2, 1] and Placement.of(2, 2, "fixed").ranks_of(0, [1, 3]) == [2, 2]
    assert p.without({1}).assign == "one-to-one" and Placement.of(4, 2, "fixed").without({1}).assign == "fixed"
    assert p.holds(1, 3, 4) == [(layer, e) for layer in range(3) for e in range(4)]
    assert Placement.of(2, 2, "fixed").holds(1, 3, 4) == Placement.of(2, 2).owned(1, 3, 4)
    with pytest.raises(MoepagerError, match="one-to-one or fixed"):
        Placement.of(2, 2, "random")  # type: ignore[arg-type]


def test_a_spread_prefill_gives_worker_i_the_experts_i_mod_w_of_every_layer():
    """OD-MoE §2.7: in a prefill pass expert e of any layer goes to worker e mod W of all W workers (decode calls keep
    to the layer's group); a resident worker holds that share besides its decode one; failover and the wire keep it;
    with one group (W = G) the group's assignment stays."""
    spread = Placement.of(3, 1, prefill="spread")
    for position in range(4):
        assert spread.ranks_of(position, list(range(8)), "prefill") == [1, 2, 3, 1, 2, 3, 1, 2]
        assert spread.ranks_of(position, [0, 5], "decode") == Placement.of(3, 1).ranks_of(position, [0, 5])
    grouped = Placement.of(3, 1)
    assert grouped.ranks_of(1, [0, 5], "prefill") == grouped.ranks_of(1, [0, 5]) == [2, 2]
    decode_share = set(Placement.of(3, 1).holds(3, 4, 8))
    held = spread.holds(3, 4, 8)
    assert set(held) == decode_share | {(p, e) for p in range(4) for e in (2, 5)} and held == sorted(held)
    left = spread.without({2})
    assert left.prefill == "spread" and left.ranks_of(0, [0, 1, 2], "prefill") == [1, 3, 1]
    header = decode(Place(3, 1, 0, WORKER_PREFILLS.index("spread")).header())
    assert isinstance(header, Place) and WORKER_PREFILLS[header.prefill_code] == "spread"
    one_group = Placement.of(2, 2, prefill="spread")  # W = G: the group's own (balanced) assignment
    assert one_group.ranks_of(0, [0, 2], "prefill") == Placement.of(2, 2).ranks_of(0, [0, 2]) == [1, 2]
    assert one_group.holds(1, 2, 4) == Placement.of(2, 2).holds(1, 2, 4)
    with pytest.raises(MoepagerError, match="spread or group"):
        Placement.of(2, 2, prefill="all")  # type: ignore[arg-type]


@pytest.mark.parametrize("prefill, memory", [(None, "100%"), (None, None), ("spread", None)],
                         ids=["spread-paged-by-default", "group-resident-by-default", "spread-resident"])
def test_a_spread_prefill_puts_every_worker_to_work_on_a_prompt_and_changes_no_token(hf_checkpoint, tmp_path,
                                                                                      prefill, memory):
    """Three workers in groups of one on a model of two MoE layers: decode calls reach workers 1 and 2 only (a layer's
    group), and with a spread prefill worker 3 computes its share of every layer of each prompt (expert e mod 3 = 2);
    with the layer's group only, it computes nothing. Paging workers spread by default (worker 3's cache is measured
    against that share: it has no home experts), resident ones keep to the group. The tokens are the single
    process's."""
    path = str(hf_checkpoint("deepseek_v2")[1])
    env = {k: v for k, v in (("MOEPAGER_TEST_PREFILL", prefill), ("MOEPAGER_TEST_WORKER_MEMORY", memory)) if v}
    got = ranks(tmp_path, 4, 1, path, env=env)
    workers = got[path + " workers"]
    assert workers[0]["calls"] > 0 and workers[1]["calls"] > 0
    assert (workers[2]["calls"] > 0) == (prefill == "spread" or memory is not None), workers


@pytest.mark.parametrize("assign, memory", [("one-to-one", None), ("fixed", None), (None, "60%")],
                         ids=["one-to-one-resident", "fixed", "one-to-one-paged-by-default"])
def test_one_to_one_assignment_never_crowds_a_worker_and_gives_the_single_process_tokens(hf_checkpoint, tmp_path,
                                                                                          assign, memory):
    """Two workers in one group of two, top-2 routing, one sequence at a time: with one-to-one assignment no layer
    call gives a worker more than its share (at a decode token, one expert each), resident (each holds every expert)
    or paged (the default there); with fixed assignment some calls put both experts on one worker. The tokens are the
    single process's."""
    paths = [str(hf_checkpoint(arch)[1]) for arch in ("mixtral", "olmoe")]
    env = {k: v for k, v in (("MOEPAGER_TEST_ASSIGN", assign), ("MOEPAGER_TEST_WORKER_MEMORY", memory),
                             ("MOEPAGER_TEST_MAX_SEQS", "1")) if v}
    got = ranks(tmp_path, 3, 2, *paths, env=env)
    for path in paths:
        calls, crowded = got[path + " crowded"]
        assert calls > 0 and (crowded > 0 if assign == "fixed" else crowded == 0), (calls, crowded)
        assert all(w["calls"] > 0 for w in got[path + " workers"])


@pytest.mark.parametrize("procs, group, shadow", [(3, 1, False), (4, 2, False), (4, 1, True)],
                         ids=["2-workers", "3-workers-groups-of-2", "shadow-and-2-workers"])
def test_workers_give_the_single_process_tokens_on_every_architecture(hf_checkpoint, tmp_path, procs, group, shadow):
    paths = [str(hf_checkpoint(arch)[1]) for arch in ARCHS]
    got = ranks(tmp_path, procs, group, *paths, env={"MOEPAGER_TEST_SHADOW": "1"} if shadow else None)
    for path in paths:
        workers = got[path + " workers"][shadow:]  # (the shadow, rank 1, answers first with its own counters)
        assert len(workers) == procs - 1 - shadow and sum(w["calls"] for w in workers) > 0
        if shadow:
            assert got[path + " workers"][0]["calls"] > 0 and sum(w["forecast"] for w in workers) > 0


def test_workers_paging_their_experts_from_disk_give_the_same_tokens(hf_checkpoint, tmp_path):
    """`--worker-memory 60%`: each worker pages its experts through a cache of 60% of them (OD-MoE's just-in-time
    loading), and the tokens stay the single-process ones."""
    paths = [str(hf_checkpoint(arch)[1]) for arch in ("olmoe", "deepseek_v2", "mixtral")]
    got = ranks(tmp_path, 3, 1, *paths, env={"MOEPAGER_TEST_WORKER_MEMORY": "60%"})
    for path in paths:
        workers = got[path + " workers"]
        assert all(w["misses"] > 0 and w["bytes_disk"] > 0 for w in workers)


@pytest.mark.parametrize("fault, says", [("die", "is gone: its connection dropped"), ("hang", "did not answer for MoE "
                                                                                         "layer 1 within 3 s")])
def test_a_lost_worker_is_named_and_nothing_hangs(hf_checkpoint, tmp_path, fault, says):
    path = str(hf_checkpoint("olmoe")[1])
    out = tmp_path / "tokens.json"
    # started as `generate --workers` starts them: under torchrun its agent may end rank 0 before it has written
    codes = spawn(3, "tests/distributed/ranks.py", str(out), "1", path, env={"MOEPAGER_TEST_FAULT": fault})
    assert codes[0] != 0
    error = json.loads(out.read_text())["error"]
    assert "worker rank 2" in error and says in error


def test_workers_without_their_processes_are_refused(hf_checkpoint):
    path = str(hf_checkpoint("olmoe")[1])
    with pytest.raises(MoepagerError, match="needs 3 processes started together"):
        LLM(config=EngineConfig(model=path, remote=RemoteConfig(workers=2)), show_progress=False)
    with pytest.raises(MoepagerError, match="drop --expert-memory"):
        from moepager.config import StoreConfig

        EngineConfig(store=StoreConfig(expert_memory="25%"), remote=RemoteConfig(workers=2))


def test_generate_with_workers_starts_them_and_prints_the_single_process_text(tmp_path):
    common = ["generate", "--threads", "1", "--max-tokens", "10", "--temperature", "0", "--ignore-eos", "--quiet",
              "The history of"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    alone = subprocess.run([sys.executable, "-m", "moepager.cli.main", *common], capture_output=True, text=True,
                           timeout=TIMEOUT_S, env=env)
    spread = subprocess.run([sys.executable, "-m", "moepager.cli.main", *common, "--workers", "2"],
                            capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    assert alone.returncode == 0 and spread.returncode == 0, spread.stderr[-3000:]
    text = alone.stdout.split("\n\n")[0]
    assert text.startswith("The history of") and spread.stdout.split("\n\n")[0] == text
    assert "on 2 worker processes" in spread.stdout


def test_a_predictor_on_the_main_rank_drives_the_workers_loads_ahead(hf_checkpoint, tmp_path):
    """--predictor with --worker-memory: the main rank's forecasts become its workers' prefetches (OD-MoE without a
    shadow rank); they load experts ahead and the tokens stay the single-process ones."""
    path = str(hf_checkpoint("qwen3_moe")[1])
    got = ranks(tmp_path, 3, 1, path, env={"MOEPAGER_TEST_WORKER_MEMORY": "60%",
                                           "MOEPAGER_TEST_PREDICTOR": "gate-lookahead"})
    assert sum(w["loads_ahead"] for w in got[path + " workers"]) > 0


def test_a_shadow_rank_forecasts_the_workers_routing_and_changes_no_token(hf_checkpoint, tmp_path):
    """--shadow: rank 1 computes every pass on an int8 copy as the main rank announces it (with --kv-align-period 1
    its KV cache realigned with the main rank's entries at every pass) and sends each layer's routing to the workers,
    who load it ahead; its forecasts name routed experts, and the tokens are the single-process ones."""
    path = str(hf_checkpoint("qwen3_moe")[1])
    got = ranks(tmp_path, 4, 1, path, env={"MOEPAGER_TEST_WORKER_MEMORY": "60%", "MOEPAGER_TEST_SHADOW": "1",
                                           "MOEPAGER_TEST_KV_ALIGN": "1"})
    shadow, workers = got[path + " workers"][0], got[path + " workers"][1:]  # rank 1, the shadow, answers first
    assert sum(w["loads_ahead"] for w in workers) > 0
    assert shadow["aligned"] > 0  # --kv-align-period 1: its cache took the main rank's entries
    sent = got[path + " kv alignment"]  # the main rank's statistics say what it sent (each position sent once)
    assert sent["period"] == 1 and sent["positions"] >= shadow["aligned"] > 0 and sent["bytes"] > 0
    # a forecast counts when it reaches the worker before the layer call it names: how many do depends on the shadow
    # keeping ahead with four processes on two cores (alone 55-65%; beside the rest of the suite 38% was seen)
    assert sum(w["forecast"] for w in workers) > 0.25 * sum(w["routed"] for w in workers)


def test_a_shadow_running_ahead_on_its_own_tokens_forecasts_later_passes_and_changes_no_token(hf_checkpoint,
                                                                                               tmp_path):
    """--align-period 3: the shadow computes up to two passes ahead of the main rank on its greedy guesses (which the
    int8 copy mostly gets right on greedy decoding), realigned at every pass (its tokens only: --kv-align-period 0);
    the tokens are the single-process ones."""
    path = str(hf_checkpoint("qwen3_moe")[1])
    got = ranks(tmp_path, 4, 1, path, env={"MOEPAGER_TEST_WORKER_MEMORY": "60%", "MOEPAGER_TEST_SHADOW": "1",
                                           "MOEPAGER_TEST_ALIGN": "3", "MOEPAGER_TEST_KV_ALIGN": "0"})
    shadow, workers = got[path + " workers"][0], got[path + " workers"][1:]
    assert shadow["loads_ahead"] > 0 and shadow["hits"] > shadow["misses"]  # passes run ahead, guesses mostly right
    assert shadow["aligned"] == 0 and got[path + " kv alignment"] is None  # --kv-align-period 0: its own cache only
    # a forecast counts when it reaches the worker before the layer call it names: how many do depends on the shadow
    # keeping ahead with four processes on two cores (alone 55-65%; beside the rest of the suite 38% was seen)
    assert sum(w["forecast"] for w in workers) > 0.25 * sum(w["routed"] for w in workers)


def test_failover_gives_a_dead_workers_experts_to_the_others_and_loses_no_token(hf_checkpoint, tmp_path):
    """--on-worker-loss failover: rank 2 of 3 workers dies at its third layer call; its experts go to ranks 1 and 3,
    the layer call is made again, and every token is the single-process one (two models, one after the other)."""
    paths = [str(hf_checkpoint(arch)[1]) for arch in ("olmoe", "deepseek_v3")]
    out = tmp_path / "tokens.json"
    codes = spawn(4, "tests/distributed/ranks.py", str(out), "1", *paths,
                  env={"MOEPAGER_TEST_FAULT": "die", "MOEPAGER_TEST_ON_LOSS": "failover"})
    assert codes[0] == 0
    got = json.loads(out.read_text())
    assert got[paths[0] + " lost"] == [2]
    for path in paths:
        assert got[path] == single_process(path), path


def test_failover_leaves_a_silent_worker_behind_and_loses_no_token(hf_checkpoint, tmp_path):
    """--on-worker-loss failover: rank 2 of 3 workers stops answering (it sleeps) at its third layer call; after the
    3 s timeout on its own link its experts go to ranks 1 and 3, which go on answering on theirs, and every token is
    the single-process one; only ranks 1 and 3 answer the stop."""
    path = str(hf_checkpoint("olmoe")[1])
    out = tmp_path / "tokens.json"
    codes = spawn(4, "tests/distributed/ranks.py", str(out), "1", path,
                  env={"MOEPAGER_TEST_FAULT": "hang", "MOEPAGER_TEST_ON_LOSS": "failover"})
    assert codes[0] == 0
    got = json.loads(out.read_text())
    assert got[path + " lost"] == [2]
    assert got[path] == single_process(path)
    workers = got[path + " workers"]
    assert len(workers) == 2 and all(w["calls"] > 0 for w in workers)


def test_failover_leaves_a_stopped_first_worker_behind_and_the_others_answer(hf_checkpoint, tmp_path):
    """`kill -STOP` on the first of 3 workers (rank 1, whose answer the main rank would await first) at its third
    layer call, with failover: the healthy workers' answers are taken while rank 1 stays silent (every receive is
    posted before any is awaited), so only rank 1 is lost, and every token is the single-process one. (Awaiting rank 1
    first once left the others' sends to time out too: "every worker is lost".)"""
    path = str(hf_checkpoint("olmoe")[1])
    out = tmp_path / "tokens.json"
    codes = spawn(4, "tests/distributed/ranks.py", str(out), "3", path,  # one group of 3: every call asks all
                  env={"MOEPAGER_TEST_FAULT": "stop", "MOEPAGER_TEST_FAULT_RANK": "1",
                       "MOEPAGER_TEST_ON_LOSS": "failover"})
    assert codes[0] == 0
    got = json.loads(out.read_text())
    assert got[path + " lost"] == [1] and got[path] == single_process(path)
    assert len(got[path + " workers"]) == 2


def test_failover_tells_the_shadow_rank_the_new_placement(hf_checkpoint, tmp_path):
    """--shadow with failover: the first worker (rank 2) dies; the workers left and the shadow rank are given the new
    placement (a shadow that did not take the message would fail the run), and the tokens are the single-process
    ones. (A worker that stops answering beside a shadow is not failed over in time: the shadow's forecast to it
    waits for the link's timeout, and so does the main rank's next message to the shadow.)"""
    path = str(hf_checkpoint("qwen3_moe")[1])
    out = tmp_path / "tokens.json"
    codes = spawn(5, "tests/distributed/ranks.py", str(out), "1", path,
                  env={"MOEPAGER_TEST_FAULT": "die", "MOEPAGER_TEST_ON_LOSS": "failover", "MOEPAGER_TEST_SHADOW": "1",
                       "MOEPAGER_TEST_WORKER_MEMORY": "60%"})
    assert codes[0] == 0
    got = json.loads(out.read_text())
    assert got[path + " lost"] == [2] and got[path] == single_process(path)
    shadow, workers = got[path + " workers"][0], got[path + " workers"][1:]
    assert shadow["calls"] > 0 and len(workers) == 2 and all(w["calls"] > 0 for w in workers)


def test_a_silent_worker_stops_a_run_without_failover_with_the_reason(hf_checkpoint, tmp_path):
    out = tmp_path / "tokens.json"
    codes = spawn(4, "tests/distributed/ranks.py", str(out), "1", str(hf_checkpoint("olmoe")[1]),
                  env={"MOEPAGER_TEST_FAULT": "hang"})
    assert codes[0] == 1
    error = json.loads(out.read_text())["error"]
    assert "worker rank 2 did not answer" in error


def generated_alone(prompt: str, env: dict[str, str]) -> str:
    """`moepager generate`'s greedy text of 8 tokens in one process (without the statistics table)."""
    alone = subprocess.run([sys.executable, "-m", "moepager.cli.main", "generate", "--threads", "1", "--max-tokens",
                            "8", "--temperature", "0", "--ignore-eos", "--quiet", prompt],
                           capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    assert alone.returncode == 0, alone.stderr[-2000:]
    return alone.stdout.split("\n\nprompts ")[0]


def started_server(args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """`moepager serve --quiet ARGS` on a free port, once /health answers: the launcher's process and the base URL."""
    import time

    import httpx

    from tests.server.conftest import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moepager.cli.main", "serve", "--port", str(port), "--quiet", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + TIMEOUT_S
    while proc.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc, f"http://127.0.0.1:{port}"
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the server's /health did not answer within {TIMEOUT_S} s: "
                                 f"{proc.communicate()[1][-3000:]}")
        time.sleep(0.2)
    raise AssertionError(proc.stderr.read()[-3000:])


@pytest.mark.parametrize("shadow", [False, True], ids=["workers", "workers-and-shadow"])
def test_serve_with_workers_answers_after_idling_past_the_worker_timeout_and_stops_them_on_sigterm(shadow):
    """`moepager serve --workers 2`: the OpenAI client's greedy completion is `generate`'s single-process text, also
    after the server sat idle longer than --worker-timeout (the workers and the shadow wait for work as long as the
    main rank is there); SIGTERM to the launcher stops the main rank, which stops every worker (their counters)."""
    import signal
    import time

    import openai

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    prompt = "The history of"
    expected = generated_alone(prompt, env)
    proc, url = started_server(["--threads", "1", "--worker-timeout", "3", "--workers", "2",
                                *(["--shadow"] if shadow else [])], env)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=60, max_retries=0)
        texts = []
        for idle_s in (0, 5):  # 5 s idle: past the 3 s --worker-timeout
            time.sleep(idle_s)
            done = client.completions.create(model="demo-moe", prompt=prompt, max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True})
            assert done.usage.completion_tokens == 8
            texts.append(prompt + done.choices[0].text)
        assert texts == [expected] * 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        err = proc.stderr.read()
        first = 2 if shadow else 1
        for rank in (first, first + 1):
            assert f"worker rank {rank}: " in err, err[-3000:]
        assert ("shadow rank 1: " in err) == shadow
    finally:
        proc.kill()


def test_failover_leaves_a_silent_worker_beside_a_shadow_behind(hf_checkpoint, tmp_path):
    """--shadow with failover, links and layer calls timing out after 3 s: the first worker (rank 2) stops answering.
    The shadow's forecast to it waits for the link's timeout once, and the main rank waits up to twice that for the
    shadow; the worker is failed over, the tokens are the single-process ones, and the shadow is still there at the
    stop."""
    path = str(hf_checkpoint("qwen3_moe")[1])
    out = tmp_path / "tokens.json"
    codes = spawn(5, "tests/distributed/ranks.py", str(out), "1", path,
                  env={"MOEPAGER_TEST_FAULT": "hang", "MOEPAGER_TEST_ON_LOSS": "failover", "MOEPAGER_TEST_SHADOW": "1",
                       "MOEPAGER_TEST_WORKER_MEMORY": "60%", "MOEPAGER_TEST_LINK_TIMEOUT": "3"})
    assert codes[0] == 0, out.read_text() if out.exists() else ""
    got = json.loads(out.read_text())
    assert got[path + " lost"] == [2] and got[path] == single_process(path)
    shadow, workers = got[path + " workers"][0], got[path + " workers"][1:]
    assert shadow["calls"] > 0 and len(workers) == 2


def test_a_shadow_that_stops_answering_is_left_behind_and_changes_no_token(hf_checkpoint, tmp_path):
    """The shadow rank stops at its third pass: the main rank waits twice the 3 s timeout for it, goes on without its
    forecasts, and every token is the single-process one; the workers answer the stop, the shadow does not."""
    path = str(hf_checkpoint("qwen3_moe")[1])
    out = tmp_path / "tokens.json"
    codes = spawn(4, "tests/distributed/ranks.py", str(out), "1", path,
                  env={"MOEPAGER_TEST_FAULT": "hang-shadow", "MOEPAGER_TEST_SHADOW": "1",
                       "MOEPAGER_TEST_WORKER_MEMORY": "60%", "MOEPAGER_TEST_LINK_TIMEOUT": "3"})
    assert codes[0] == 0, out.read_text() if out.exists() else ""
    got = json.loads(out.read_text())
    assert got[path + " shadow lost"] is True and got[path + " lost"] == []
    assert got[path] == single_process(path)
    workers = got[path + " workers"]
    assert len(workers) == 2 and all(w["routed"] > 0 for w in workers)


@pytest.mark.parametrize("loss", ["stop", "failover"])
def test_serve_with_workers_after_a_worker_is_killed(loss):
    """`moepager serve --workers 2`, and worker rank 2's process killed between two requests. Under
    `--on-worker-loss stop` the server stays up to say so: the next request is refused with 503 naming the rank, and
    /health answers 503 with the reason. Under `failover` the next request completes with the single-process text."""
    import signal
    import time

    import httpx
    import openai
    import psutil

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    prompt = "The history of"
    expected = generated_alone(prompt, env)
    proc, url = started_server(["--threads", "1", "--worker-timeout", "5", "--workers", "2", "--on-worker-loss", loss],
                               env)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=60, max_retries=0)

        def complete() -> str:
            done = client.completions.create(model="demo-moe", prompt=prompt, max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True})
            return prompt + done.choices[0].text

        assert complete() == expected
        ranks = {int(p.environ().get("RANK", -1)): p for p in psutil.Process(proc.pid).children(recursive=True)
                 if "RANK" in p.environ()}
        assert set(ranks) == {0, 1, 2}, ranks
        ranks[2].send_signal(signal.SIGKILL)
        while time.monotonic() < deadline:  # dead (a zombie until the launcher reaps it at the end)
            try:
                if ranks[2].status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.05)
        if loss == "failover":
            assert complete() == expected
            assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        else:
            with pytest.raises(openai.APIStatusError) as refused:
                complete()
            assert refused.value.status_code == 503 and "worker rank 2" in str(refused.value), str(refused.value)
            health = httpx.get(f"{url}/health", timeout=5)
            assert health.status_code == 503 and "worker rank 2" in health.json()["reason"], health.text
            with pytest.raises(openai.APIStatusError) as later:
                complete()
            assert later.value.status_code == 503 and "can no longer generate" in str(later.value)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert "worker rank 1: " in proc.stderr.read()  # the worker left answers the stop with its counters
    finally:
        proc.kill()


def test_chat_with_workers_answers_as_one_process_and_ctrl_c_stops_only_the_answer():
    """`moepager chat --workers 2` answers a turn with the single-process chat's greedy text. Ctrl-C (SIGINT to the
    whole process group, as a terminal sends it) during a long answer ends that answer after the step then running
    (" [stopped]"), the chat goes on (/stats reports the stopped answer), and /exit stops the workers (their
    counters) with status 0."""
    import signal
    import threading
    import time

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    chat = [sys.executable, "-m", "moepager.cli.main", "chat", "--temperature", "0", "--quiet", "--threads", "1"]
    alone = subprocess.run([*chat, "--max-tokens", "8"], input="Hello there\n/exit\n", capture_output=True, text=True,
                           timeout=TIMEOUT_S, env=env)
    assert alone.returncode == 0, alone.stderr[-2000:]
    both = subprocess.run([*chat, "--max-tokens", "8", "--workers", "2"], input="Hello there\n/exit\n",
                          capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    assert both.returncode == 0, both.stderr[-3000:]
    assert both.stdout == alone.stdout and "> " in both.stdout
    assert "worker rank 1: " in both.stderr and "worker rank 2: " in both.stderr

    proc = subprocess.Popen([*chat, "--max-tokens", "100000", "--workers", "2"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(iter(lambda: proc.stdout.read(1), "")), daemon=True)
    reader.start()
    try:
        proc.stdin.write("Hello there\n")  # the built-in model answers it at length (no end of text for 300 tokens)
        proc.stdin.flush()
        deadline = time.monotonic() + TIMEOUT_S
        while "".join(out).count("> ") < 1 or len("".join(out).split("> ", 1)[1]) < 40:  # the answer is streaming
            assert time.monotonic() < deadline and proc.poll() is None, "".join(out)
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        while " [stopped]" not in "".join(out):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(out)
            time.sleep(0.05)
        proc.stdin.write("/stats\n/exit\n")
        proc.stdin.flush()
        assert proc.wait(timeout=TIMEOUT_S) == 0
        reader.join(timeout=10)
        stopped = "".join(out).split(" [stopped]")[1]
        assert stopped.lstrip().startswith("> prompt ") and "answer" in stopped and "history 2 messages" in stopped
        err = proc.stderr.read()
        assert "worker rank 1: " in err and "worker rank 2: " in err, err[-3000:]
    finally:
        proc.kill()
