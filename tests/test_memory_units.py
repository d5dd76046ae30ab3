"""One memory unit everywhere: the worker's --max-memory-gb and the topology's max_memory_gb both count GiB."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from cluster import worker_hello
from tc.batch_memory import plan_batch, stage_need
from tc.cli import build_parser
from tc.head.admission import stage_fit_problem
from tc.model.config import ModelConfig
from tc.planner import NodeSpec, Stage, make_plan, node_specs
from tc.topology import NodeEntry, parse_topology
from tc.worker.main import worker_options
from tiny_model import tiny_config

GIB = 2**30


def flag_bytes(gib: str) -> int | None:
    args = build_parser().parse_args(["worker", "--join", "head:7001", "--max-memory-gb", gib])
    return worker_options(args, {}).max_memory_bytes


def topology_bytes(gib: float, base_dir: Path) -> int | None:
    data = {"model": "Qwen/Qwen2.5-0.5B-Instruct", "quant": "int8", "dtype": "bf16",
            "head": {"api": "127.0.0.1:8000", "listen": "127.0.0.1:7001"},
            "nodes": [{"id": "a", "device": "cpu", "max_memory_gb": gib}]}
    return node_specs(parse_topology(data, base_dir))[0].memory_bytes


@pytest.mark.parametrize("gib, expected", [("1", GIB), ("1.5", 3 * GIB // 2), ("0.25", GIB // 4), ("24", 24 * GIB)])
def test_the_flag_and_the_topology_key_mean_the_same_bytes(tmp_path, gib, expected):
    assert flag_bytes(gib) == expected
    assert topology_bytes(float(gib), tmp_path) == expected


def test_no_flag_leaves_the_memory_to_the_device():
    args = build_parser().parse_args(["worker", "--join", "head:7001"])
    assert worker_options(args, {}).max_memory_bytes is None


def test_the_help_names_the_unit(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--max-memory-gb GIB" in help_text and "in GiB (2**30 bytes) like the topology's max_memory_gb" in help_text




def stage(weight_bytes: int) -> Stage:
    return Stage(node_id="a", device="cpu", dtype="bf16", start=0, end=4, weight_bytes=weight_bytes,
                 memory_bytes=None)


def test_a_worker_given_one_gib_holds_layers_between_a_gb_and_a_gib():
    entry = NodeEntry(id="a", device="cpu", dtype=None, max_memory_gb=None, layers=None, threads=None)
    offered = worker_hello("a", compute_dtypes=("bf16",), max_memory_bytes=flag_bytes("1"))
    config = ModelConfig.from_dict(tiny_config())  # one sequence's KV cache on its 4 layers: 128 KiB in bf16
    assert stage_fit_problem(entry, offered, stage(1_050_000_000), config, 1) is None  # over 10**9, under 2**30
    problem = stage_fit_problem(entry, offered, stage(GIB + 1), config, 1)
    assert problem is not None and "offers 1.00 GiB" in problem and "--max-memory-gb, in GiB" in problem


def test_where_the_batch_floors_at_one_a_worker_needs_only_what_the_plan_counted():
    """Left to the memory, the batch is one sequence even where a node's max_memory_gb holds none at full context
    (caches fill only as far as sequences go). The join check counts what the plan counted for that node, its
    weights here, so a worker offering the node's memory is admitted, and one short of the weights is not."""
    config = ModelConfig.from_dict(tiny_config())
    weights = 4 << 20
    memory = weights + 64 * 1024  # half of one sequence's 128 KiB bf16 cache on the 4 layers
    plan = make_plan(4, [1 << 20] * 4, [NodeSpec("a", "cpu", "bf16", memory, None)])
    assert plan_batch(plan, config, None).max_batch == 1
    need = stage_need(config, plan.stages[0], 1)
    assert (need.weight_bytes, need.sequences, need.total_bytes) == (weights, 0, weights)
    entry = NodeEntry(id="a", device="cpu", dtype=None, max_memory_gb=memory / GIB, layers=None, threads=None)
    assert stage_fit_problem(entry, worker_hello("a", max_memory_bytes=memory), plan.stages[0], config, 1) is None
    short = stage_fit_problem(entry, worker_hello("a", max_memory_bytes=weights - 1), plan.stages[0], config, 1)
    assert short is not None and "needs 4.0 MiB: 4.0 MiB of weights + 0 B of KV cache for 0 sequence(s)" in short


def test_a_spare_on_a_cpu_is_counted_fp16_caches_as_it_computes_them_in_fp32():
    """fp16 on a CPU computes, and caches, in fp32: a CPU spare for a CUDA node's fp16 stage needs twice the KV
    cache the stage counts on its own device, and is told so."""
    config = ModelConfig.from_dict(tiny_config())
    on_gpu = Stage(node_id="g", device="cuda", dtype="fp16", start=0, end=4, weight_bytes=1 << 20,
                   memory_bytes=None)
    spare = NodeEntry(id="s", device="auto", dtype=None, max_memory_gb=None, layers=None, threads=None, spare=True)
    assert stage_need(config, on_gpu, 8).slot_bytes == 128 * 1024
    gpu_count = worker_hello("s", max_memory_bytes=(1 << 20) + 8 * 128 * 1024)
    problem = stage_fit_problem(spare, gpu_count, on_gpu, config, 8)
    assert problem is not None and "2.0 MiB of KV cache for 8 sequence(s) of 256.0 KiB each" in problem, problem
    assert "on cpu" in problem and "declare a spare with more memory" in problem
    enough = worker_hello("s", max_memory_bytes=(1 << 20) + 8 * 256 * 1024)
    assert stage_fit_problem(spare, enough, on_gpu, config, 8) is None


def test_a_worker_told_of_more_memory_or_threads_than_the_machine_has_is_warned(caplog):
    """--max-memory-gb past the device's memory and --threads past the cores are taken (whoever starts the worker
    may know better), with a warning that says what follows and what to give instead; within them, no word."""
    from tc.worker.device import detect_devices
    from tc.worker.main import warn_past_the_memory
    from tc.worker.runtime import warn_past_the_cores

    devices = detect_devices("cpu")
    total = devices[-1].total_memory
    with caplog.at_level("WARNING", logger="tc.worker"):
        assert warn_past_the_memory(total + GIB, "cpu", devices)
        assert not warn_past_the_memory(total, "cpu", devices) and not warn_past_the_memory(None, "cpu", devices)
        assert warn_past_the_cores(64, "--threads", cpus=2)
        assert not warn_past_the_cores(2, "--threads", cpus=2)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said
    assert said[0].startswith(f"--max-memory-gb offers {(total + GIB) / GIB:.1f} GiB, and cpu has "
                              f"{total / GIB:.1f} GiB")
    assert said[0].endswith(f"run out of it while loading; give {math.floor(total / GIB * 10) / 10:.1f} or less")
    assert said[1] == ("--threads: 64 torch threads, and this process may run on 2 CPUs; threads past the CPUs slow "
                       "every step (each product waits for its slowest thread): give 2 or fewer")


def test_an_entry_that_no_longer_gives_threads_takes_the_process_s_own_count_again(monkeypatch):
    """A worker kept the threads of an earlier assignment's entry when a restarted head's topology dropped the
    key: it ran on with them, and nothing said why its stage was slow. --threads still wins over both."""
    import torch

    from tc.worker import runtime
    from tc.worker.runtime import apply_threads

    monkeypatch.setattr(runtime, "_OWN_THREADS", [])  # as in a worker process, whatever ran here before
    own = torch.get_num_threads()
    other = 1 if own != 1 else 2
    try:
        apply_threads(other, None)
        assert torch.get_num_threads() == other
        apply_threads(None, None)
        assert torch.get_num_threads() == own
        apply_threads(other, own)  # --threads given: the entry's count is not taken
        assert torch.get_num_threads() == own
    finally:
        torch.set_num_threads(own)
