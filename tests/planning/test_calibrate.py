"""`moepager calibrate` measures this machine for a model and writes a profile the cost model and simulate read."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from moepager.cli.main import main
from moepager.errors import MoepagerError
from moepager.planning.cost import CalibratedProfile, Calibration, CostModel, Device, Link
from tests.trace.conftest import random_trace


def test_calibrate_writes_a_profile_that_simulate_uses(demo_checkpoint, tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert main(["calibrate", "--model", str(demo_checkpoint), "--threads", "1", "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "per decode step" in printed and "disk" in printed
    profile = CalibratedProfile.read(out)
    c = profile.calibration
    assert c.expert_s_64 > 0 and c.expert_s_1 > 0 and c.dense_decode_s > 0 and c.threads == 1
    assert profile.link.bytes_per_s > 0 and profile.measured["copy_Bps"] > 0
    assert not list(tmp_path.glob("*.partial"))
    trace = random_trace(tmp_path / "t.mpt")
    assert main(["simulate", str(trace), "--capacity", "4", "--profile", str(out), "--expert-bytes",
                 str(c.expert_bytes), "--json", str(tmp_path / "s.json")]) == 0
    row = json.loads((tmp_path / "s.json").read_text())["rows"][0]
    assert row["tpot_ms"] > 1e3 * c.dense_decode_s  # every step pays the non-expert time, then its experts


def test_a_quantized_checkpoint_is_calibrated_in_its_own_format(demo_checkpoint, tmp_path):
    """A `moepager quantize` copy is measured as a run pages it: int4 buffers read from disk and computed by the
    int4 kernels, so the profile's expert bytes are the int4 expert's (a float reader failed on its tensors)."""
    from moepager.experts.weights import ExpertShape
    from moepager.runtime.builder import load_model

    quantized = tmp_path / "int4"
    assert main(["quantize", "--model", str(demo_checkpoint), "--experts", "int4", "--out", str(quantized)]) == 0
    out = tmp_path / "profile.json"
    assert main(["calibrate", "--model", str(quantized), "--threads", "1", "--out", str(out), "--quiet"]) == 0
    shape: ExpertShape = load_model(quantized, show_progress=False).expert_shape
    c = CalibratedProfile.read(out).calibration
    assert shape.quant is not None and c.expert_bytes == shape.nbytes < shape.float_shape.nbytes
    assert c.expert_s_1 > 0 and c.expert_s_64 > 0


def test_a_profile_for_other_experts_or_a_broken_file_is_refused(tmp_path):
    profile = CalibratedProfile("p", Device("d", 1e10, 1e12, 1e-5), Link("l", 1e9, 1e-4),
                                Calibration(1000, 1e-4, 2e-4, 1e-3, 20.0, 0.0, 1e-5, 0.0, "m", 2, "cpu"), {})
    old = tmp_path / "v1.json"
    profile.write(old)
    old.write_text(old.read_text().replace('"version": 2', '"version": 1'))
    with pytest.raises(MoepagerError, match="version 1, written by an older moepager"):
        CostModel.profile(str(old), 1000)
    profile.write(tmp_path / "p.json")
    with pytest.raises(ValueError, match="calibrated for 1000-byte experts"):
        CostModel.profile(str(tmp_path / "p.json"), 2000)
    (tmp_path / "junk.json").write_text("{\"kind\": \"something else\"}")
    with pytest.raises(MoepagerError, match="not a moepager profile"):
        CostModel.profile(str(tmp_path / "junk.json"), 1000)
    assert main(["simulate", str(random_trace(tmp_path / "t.mpt")), "--profile", str(tmp_path / "junk.json")]) == 2


def test_calibrated_step_times_add_non_expert_time_and_interpolate_experts():
    cal = Calibration(expert_bytes=1000, expert_s_1=1.0, expert_s_64=64.0, dense_decode_s=10.0, dense_decode_kv=20.0,
                      dense_kv_s=0.0, dense_token_s=0.5, io_slowdown=0.0, model="m", threads=1,
                      device="cpu")
    cost = CostModel(Device("d", 1e12, 1e15, 0.0), Link("l", 1000.0, 0.0), 1000, calibration=cal)
    # one layer, 2 experts requested, both hit, one token of top-2: 2 experts x c(1) + dense(1)
    t = cost.step_times(np.array([[2]]), np.array([[2]]), np.zeros((1, 1)), np.array([1]), 2, False)
    assert t.tolist() == [2 * 1.0 + 10.0]
    # 4 tokens on one expert: c(4) = 1 + 3 * (63 / 63); dense(4) = 10 + 3 * 0.5
    t = cost.step_times(np.array([[1]]), np.array([[1]]), np.zeros((1, 1)), np.array([4]), 1, False)
    assert t.tolist() == [4.0 + 11.5]
    # a miss: load 1000 bytes at 1000 B/s = 1 s; max(n*c, l + m*c, m*l + c) = max(1, 2, 2)
    t = cost.step_times(np.array([[1]]), np.array([[0]]), np.zeros((1, 1)), np.array([1]), 1, False)
    assert t.tolist() == [2.0 + 10.0]
    # reads slow only the compute that runs beside them: one miss alone computes after it lands (nothing slowed);
    # 3 hits + 1 miss: 3 s of hits run while the 1 s load is in flight, 1 s of it slowed by 50%:
    # max(n*c + 0.5 * min(3, 1), l + c, l + c) = 4.5
    slowed = CostModel(cost.device, cost.link, 1000, calibration=replace(cal, io_slowdown=0.5))
    t = slowed.step_times(np.array([[1]]), np.array([[0]]), np.zeros((1, 1)), np.array([1]), 1, False)
    assert t.tolist() == [2.0 + 10.0]
    t = slowed.step_times(np.array([[4]]), np.array([[3]]), np.zeros((1, 1)), np.array([1]), 4, False)
    assert t.tolist() == [4.5 + 10.0]
    # a layer waiting on its loads hides the slowed compute: 4 misses at 250 B/s land at 4, 8, 12, 16 s; the
    # first three compute (slowed) before the last lands, which then computes: 17 s
    slow_link = CostModel(cost.device, Link("l", 250.0, 0.0), 1000, calibration=replace(cal, io_slowdown=0.5))
    t = slow_link.step_times(np.array([[4]]), np.array([[0]]), np.zeros((1, 1)), np.array([1]), 4, False)
    assert t.tolist() == [17.0 + 10.0]
    # background prefetches (2 s of loads) slow the step's compute they overlap (12 s): 2 s of it by 50%
    t = slowed.step_times(np.array([[1]]), np.array([[1]]), np.array([[2]]), np.array([1]), 1, False)
    assert t.tolist() == [11.0 + 1.0]
    # a decode step's non-expert time grows with the KV cache it attends over
    longer = CostModel(cost.device, cost.link, 1000, calibration=replace(cal, dense_kv_s=0.01))
    t = longer.step_times(np.array([[1]]), np.array([[1]]), np.zeros((1, 1)), np.array([1]), 1, False,
                          np.array([120]))
    assert t.tolist() == [pytest.approx(1.0 + 10.0 + 0.01 * (120 - 20))]


def test_a_layers_misses_load_together_paying_the_latency_once():
    """The store issues a layer's misses at once on its I/O threads: the first lands after one load (rate +
    latency), the rest follow at the aggregate rate; serial loads would pay the latency per miss."""
    cal = Calibration(expert_bytes=1000, expert_s_1=0.1, expert_s_64=6.4, dense_decode_s=0.0, dense_decode_kv=20.0,
                      dense_kv_s=0.0, dense_token_s=0.0, io_slowdown=0.0, model="m", threads=1,
                      device="cpu")
    cost = CostModel(Device("d", 1e12, 1e15, 0.0), Link("l", 1000.0, 2.0), 1000, calibration=cal)
    # 4 misses of one token each, top-4: first lands at 1 + 2 = 3 s, the last at 3 + 3 * 1 = 6 s, then computes
    t = cost.step_times(np.array([[4]]), np.array([[0]]), np.zeros((1, 1)), np.array([1]), 4, False)
    assert t.tolist() == [pytest.approx(6.0 + 0.1)]
    serial = CostModel(cost.device, cost.link, 1000, overlap="none", calibration=cal)
    t = serial.step_times(np.array([[4]]), np.array([[0]]), np.zeros((1, 1)), np.array([1]), 4, False)
    assert t.tolist() == [pytest.approx(4 * 3.0 + 4 * 0.1)]


def test_disk_sampler_averages_fresh_samples_into_one_link(demo_checkpoint):
    from moepager.planning.calibrate import DiskSampler

    sampler = DiskSampler(demo_checkpoint, io_threads=2)
    try:
        rates = [sampler.sample(count=4) for _ in range(3)]
    finally:
        sampler.close()
    link = sampler.link(1000)
    assert link.bytes_per_s == pytest.approx(sum(r[0] for r in rates) / 3) and link.latency_s >= 0
    assert "mean of 3 samples" in link.name
