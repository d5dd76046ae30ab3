"""One memory unit everywhere: the worker's --max-memory-gb and the topology's max_memory_gb both count GiB."""
from __future__ import annotations

from pathlib import Path

import pytest

from cluster import worker_hello
from tc.cli import build_parser
from tc.head.admission import stage_fit_problem
from tc.planner import Stage, node_specs
from tc.topology import NodeEntry, parse_topology
from tc.worker.main import worker_options

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
    assert stage_fit_problem(entry, offered, stage(1_050_000_000)) is None  # over 10**9, under 2**30
    problem = stage_fit_problem(entry, offered, stage(GIB + 1))
    assert problem is not None and "offers 1.00 GiB" in problem and "--max-memory-gb, in GiB" in problem
