"""`moepager simulate`: table, JSON with per-layer rates, PNG, and user errors as one line."""

from __future__ import annotations

import json

from moepager.cli.main import main
from tests.trace.conftest import random_trace


def test_simulate_sweep_writes_table_json_and_plot(tmp_path, capsys):
    trace = random_trace(tmp_path / "t.mpt")
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    assert main(["simulate", str(trace), "--policy", "lru,lcp,belady,static-hot", "--capacity", "2,4,6MiB",
                 "--order", "recorded", "--prior", str(trace), "--profile", "h100-pcie5",
                 "--json", str(out_json), "--plot", str(out_png)]) == 0
    table = capsys.readouterr().out
    assert "belady" in table and "TPOT ms" in table
    rows = json.loads(out_json.read_text())["rows"]
    assert len(rows) == 12 and {r["capacity"] for r in rows} == {2, 4}  # 6 MiB = 6 experts over 3 layers = 2
    assert all(len(r["layer_hit_rates"]) == 3 and r["tpot_ms"] > 0 and r["ttft_ms"] > 0 for r in rows)
    by = {(r["policy"], r["capacity"]): r["hit_rate"] for r in rows}
    assert by[("belady", 4)] >= max(by[("lru", 4)], by[("lcp", 4)])
    assert out_png.read_bytes()[:4] == b"\x89PNG"


def test_simulate_errors(tmp_path, capsys):
    trace = random_trace(tmp_path / "t.mpt")
    assert main(["simulate", str(trace), "--policy", "lur"]) == 2
    assert main(["simulate", str(trace), "--capacity", "1"]) == 2
    assert main(["simulate", str(trace), "--policy", "static-hot"]) == 2
    err = capsys.readouterr().err
    assert "unknown eviction policy 'lur'" in err and "use at least 2" in err and "needs a prior" in err


def test_simulate_compares_oracle_horizons(tmp_path, capsys):
    trace = random_trace(tmp_path / "t.mpt")
    out_json = tmp_path / "r.json"
    assert main(["simulate", str(trace), "--policy", "plec-lrfu", "--capacity", "4", "--forecast", "oracle",
                 "--horizon", "1,4", "--json", str(out_json)]) == 0
    assert "plec-lrfu/oracle4" in capsys.readouterr().out
    assert [r["horizon"] for r in json.loads(out_json.read_text())["rows"]] == [1, 4]
    assert main(["simulate", str(trace), "--horizon", "4"]) == 2
    assert main(["simulate", str(trace), "--forecast", "oracle", "--horizon", "0,2"]) == 2
    err = capsys.readouterr().err
    assert "needs forecast 'oracle'" in err and "whole numbers of steps" in err


def test_simulate_replays_a_fitted_predictors_forecasts(tmp_path, capsys):
    trace = random_trace(tmp_path / "t.mpt")
    head = tmp_path / "head.pt"
    assert main(["predictor", "fit", "--kind", "head", "--trace", str(trace), "--out", str(head),
                 "--distances", "1,3", "--head-epochs", "2"]) == 0
    out_json = tmp_path / "r.json"
    assert main(["simulate", str(trace), "--policy", "lru,plec", "--capacity", "4", "--forecast", "predictor",
                 "--predictor", "head", "--predictor-file", str(head), "--prefetch", "2", "--json", str(out_json)]) == 0
    rows = json.loads(out_json.read_text())["rows"]
    assert [r["prefetch"] for r in rows] == [2, 2] and "plec/predictor+pf2" in capsys.readouterr().out
    assert all(r["loads"] >= r["misses"] for r in rows)  # prefetches are loads too
    assert main(["simulate", str(trace), "--policy", "plec", "--prefetch", "2"]) == 2
    assert main(["simulate", str(trace), "--policy", "plec", "--forecast", "predictor"]) == 2
    no_next = tmp_path / "near.pt"
    assert main(["predictor", "fit", "--kind", "head", "--trace", str(trace), "--out", str(no_next),
                 "--distances", "1", "--head-epochs", "1"]) == 0
    assert main(["simulate", str(trace), "--policy", "plec", "--forecast", "predictor", "--predictor", "head",
                 "--predictor-file", str(no_next)]) == 2
    err = capsys.readouterr().err
    assert "(--forecast predictor)" in err and "needs --predictor NAME" in err and "--distances ...,3" in err


def test_simulate_compares_gpu_and_hybrid_execution(tmp_path, capsys):
    trace = random_trace(tmp_path / "t.mpt")
    out_json = tmp_path / "r.json"
    assert main(["simulate", str(trace), "--policy", "lru", "--capacity", "4", "--order", "recorded",
                 "--execution", "gpu,hybrid,hybrid+admit1", "--profile", "h100-pcie3", "--expert-bytes", str(17 << 20),
                 "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "hybrid placement (h100-pcie3): a missing expert on the device from" in out and "lru/hybrid" in out
    assert "lru/hybrid+admit1" in out
    gpu, hybrid, admit = json.loads(out_json.read_text())["rows"]
    assert (gpu["execution"], hybrid["execution"], hybrid["admit"], admit["admit"]) == ("gpu", "hybrid", 0, 1)
    assert 0 < admit["prefetch_loads"] and admit["hit_rate"] >= hybrid["hit_rate"]
    assert hybrid["on_cpu_per_token"] > 0 and hybrid["bytes_per_token"] < gpu["bytes_per_token"]
    assert main(["simulate", str(trace), "--execution", "hybrid"]) == 2
    assert main(["simulate", str(trace), "--execution", "npu", "--profile", "h100-pcie3"]) == 2
    err = capsys.readouterr().err
    assert "give --profile" in err and "choose gpu, hybrid or hybrid+admitN" in err


def test_simulate_models_od_moe_worker_machines(tmp_path, capsys):
    trace = random_trace(tmp_path / "t.mpt")
    assert main(["simulate", str(trace), "--capacity", "4", "--profile", "rtx4090-pcie4", "--expert-bytes",
                 str(300 << 20), "--workers", "2,4,8", "--worker-group", "2", "--shadow-recall", "0.97",
                 "--worker-assign", "one-to-one,fixed"]) == 0
    out = capsys.readouterr().out
    assert "OD-MoE on paper: RTX 4090 workers" in out and "shadow recall 0.97" in out
    rows = [line.split() for line in out.splitlines()[-6:]]
    assert [r[1] for r in rows] == ["one-to-one", "fixed"] * 3
    rates = [float(r[2]) for r in rows]
    assert rates[0] <= rates[2] <= rates[4]  # more groups: a longer window to load in
    assert all(one >= fixed for one, fixed in zip(rates[::2], rates[1::2], strict=True))  # no call waits on a crowd
    crowded = [float(r[5].rstrip("%")) for r in rows]
    assert crowded[::2] == [0.0] * 3 and all(c > 0 for c in crowded[1::2])
    assert main(["simulate", str(trace), "--capacity", "4", "--profile", "rtx4090-pcie4", "--workers", "2",
                 "--worker-assign", "random"]) == 2
    assert "choose one-to-one or fixed" in capsys.readouterr().err
    assert main(["simulate", str(trace), "--workers", "2"]) == 2
    assert "give --profile" in capsys.readouterr().err
