"""The worker's self-measurement: real timings on this machine's CPU, the cache, and `worker --bench`."""
from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch

from tc.speed import LinkSpeed, Speed, fit_line
from tc import bench
from tc.cli import build_parser
from tc.worker.main import WorkerOptions, worker_options
from cluster import ROOT
from throttle import Throttle


def test_cost_model_is_overhead_plus_bytes_over_rate():
    speed = Speed(decode_bytes_per_s=1e9, prefill_bytes_per_s=1e11, layer_overhead_s=1e-4)
    assert speed.decode_s(30_000_000, 3) == pytest.approx(3e-4 + 0.03)
    assert speed.prefill_s(30_000_000, 3, 100) == pytest.approx(3e-4 + 0.03)
    assert Speed.from_topology(**speed.as_topology()) == speed
    assert LinkSpeed(0.001, 1e8).hop_s(1_000_000) == pytest.approx(0.001 + 0.02)
    assert LinkSpeed(0.001, None).hop_s(1_000_000) == 0.001


@pytest.mark.parametrize("bad", [dict(decode_bytes_per_s=0.0), dict(prefill_bytes_per_s=float("inf")),
                                 dict(layer_overhead_s=-1.0)])
def test_a_speed_out_of_range_is_refused(bad):
    fields = {**dict(decode_bytes_per_s=1e9, prefill_bytes_per_s=1e9, layer_overhead_s=0.0), **bad}
    with pytest.raises(ValueError, match="Speed"):
        Speed(**fields)


def test_fit_line_floors_a_negative_intercept():
    assert fit_line((1.0, 2.0), (3.0, 6.0)) == (0.0, 2.0)
    assert fit_line((0.0, 1.0), (10.0, 2.0)) == pytest.approx((1.0, 0.1))
    with pytest.raises(ValueError):
        fit_line((2.0, 1.0), (1.0, 2.0))


def _bench_decode_gbps(tmp_path, name: str, duty: float | None) -> float:
    """`worker --bench` in its own process, held to `duty` of a core when given; its bf16 fp16 decode GB/s."""
    proc = subprocess.Popen([sys.executable, "-m", "tc", "worker", "--bench", "--device", "cpu", "--threads", "1",
                             "--bench-dir", str(tmp_path / name)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    throttle = Throttle(proc.pid, duty).start() if duty is not None else None
    try:
        out, _ = proc.communicate(timeout=300 / (duty or 1))  # held, it measures at `duty` of the speed
    finally:
        if throttle is not None:
            throttle.stop()
    assert proc.returncode == 0
    row = next(line.split() for line in out.splitlines() if line.split()[:3] == ["cpu", "bf16", "fp16"])
    return float(row[3])


def test_a_worker_held_to_a_third_of_a_core_measures_itself_slower(tmp_path):
    """The real means the unequal-workers benchmark uses: a CPU quota shows in the worker's own figures."""
    full = _bench_decode_gbps(tmp_path, "full", None)
    held = _bench_decode_gbps(tmp_path, "held", 0.3)
    assert held < 0.6 * full, (held, full)


def test_figures_are_cached_per_setting_and_a_foreign_file_is_measured_again(tmp_path):
    first = bench.measure_all("cpu", "test cpu", ("fp32",), tmp_path)
    assert {f.quant for f in first} == {"fp16", "int8", "int4"}
    files = sorted(tmp_path.glob("*.json"))
    assert len(files) == 3 and all("fp32" in f.name and "test_cpu" in f.name for f in files)
    assert bench.measure_all("cpu", "test cpu", ("fp32",), tmp_path) == first  # read back, not measured
    stale = files[0]
    stale.write_text(json.dumps({**json.loads(stale.read_text()), "format": bench.BENCH_FORMAT + 1}))
    again = bench.measure_all("cpu", "test cpu", ("fp32",), tmp_path)
    assert again != first  # one figure was measured afresh (timings never repeat to the last bit)
    assert json.loads(stale.read_text())["format"] == bench.BENCH_FORMAT
    stale.write_text("{not json")
    assert len(bench.measure_all("cpu", "test cpu", ("fp32",), tmp_path)) == 3


def test_figures_are_kept_in_tc_cache_dir_unless_the_worker_is_given_a_bench_dir(tmp_path):
    def options(*flags: str) -> WorkerOptions:
        args = build_parser().parse_args(["worker", "--join", "h:7001", *flags])
        return worker_options(args, {"TC_CACHE_DIR": str(tmp_path / "cache")})

    assert options().bench_dir == tmp_path / "cache" / "bench"
    assert options("--bench-dir", str(tmp_path / "mine")).bench_dir == tmp_path / "mine"


def test_worker_bench_prints_the_figures_and_the_topology_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "tc", "worker", "--bench", "--device", "cpu", "--threads", "1",
                          "--bench-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "decode GB/s" in out.stdout and "speed: {decode_gbps:" in out.stdout
    assert len(list(tmp_path.glob("*-t1-*.json"))) == 6  # bf16 and fp32, three weight modes each


def test_worker_without_join_or_bench_says_what_to_give():
    out = subprocess.run([sys.executable, "-m", "tc", "worker"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "--join" in out.stderr and "--bench" in out.stderr


def test_a_link_is_fitted_from_its_fastest_echoes():
    # 3 empty PINGs (the least is the latency), 3 carrying 1 MB each way (the least, less the latency, is 2 MB)
    link = LinkSpeed.from_probes([0.0004, 0.0002, 0.0009], [0.0032, 0.0022, 0.0050], 1_000_000)
    assert link.round_trip_s == pytest.approx(0.0002)
    assert link.bytes_per_s == pytest.approx(2_000_000 / 0.002)
    assert link.hop_s(1792) == pytest.approx(0.0002 + 2 * 1792 / 1e9)
    assert "1.00 GB/s" in link.describe()
    # no echo at all: nothing known; no large echo, or none slower than the small ones: latency alone
    assert LinkSpeed.from_probes([], [], 1_000_000) is None
    assert LinkSpeed.from_probes([0.001], [], 1_000_000) == LinkSpeed(0.001, None)
    assert LinkSpeed.from_probes([0.001], [0.0009], 1_000_000) == LinkSpeed(0.001, None)
    assert "bandwidth not measured" in LinkSpeed(0.001, None).describe()


def test_a_figure_says_whether_it_was_measured_on_native_products():
    from tc.model import dense, native

    native_int4 = native.faster_than_torch("int4")
    assert bench.cache_key("cpu", "x", "bf16", "int4", 2).endswith("-native.json") is native_int4
    assert not bench.cache_key("cpu", "x", "fp32", "int4", 2).endswith("-native.json")  # fp32 never quantizes x
    # fp16 weights: native where the bf16 product may be chosen, never in fp32
    assert bench.cache_key("cpu", "x", "bf16", "fp16", 2).endswith("-native.json") is dense.native_bf16_available()
    assert not bench.cache_key("cpu", "x", "fp32", "fp16", 2).endswith("-native.json")


def test_a_start_that_measures_says_what_for_and_where_it_keeps_the_figures_once(tmp_path, caplog):
    """A first start spends up to a minute on probe lines before it joins: one line says what they are."""
    with caplog.at_level(logging.INFO, logger="tc.bench"):
        bench.measure_all("cpu", "test cpu", ("fp32",), tmp_path, modes=("fp16", "int8"))
        said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("measuring")]
        assert said == [f"measuring this machine's cpu for the head's planner (fp32 fp16, fp32 int8; "
                        f"{torch.get_num_threads()} threads; kept in {tmp_path} for later starts)"]
        caplog.clear()
        bench.measure_all("cpu", "test cpu", ("fp32",), tmp_path, modes=("fp16", "int8"))  # read back
        assert not caplog.records
