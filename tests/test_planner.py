"""The static planner: splits, pins, impossible topologies, and the coverage property over random inputs."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tc.planner import (
    NodeSpec,
    Plan,
    PlanError,
    Stage,
    format_bytes,
    layer_weight_bytes,
    make_plan,
    node_specs,
)
from tc.topology import load_topology, parse_topology

GIB = 1 << 30
MIB = 1 << 20
REPO_ROOT = Path(__file__).resolve().parents[1]


def node(node_id: str, memory_gb: float | None = None, pin: tuple[int, int] | None = None,
         device: str = "cpu", dtype: str = "fp32") -> NodeSpec:
    memory = None if memory_gb is None else int(memory_gb * GIB)
    return NodeSpec(node_id, device, dtype, memory, pin)


def ranges(plan: Plan) -> list[tuple[int, int]]:
    return [(s.start, s.end) for s in plan.stages]


# --- splits that work ------------------------------------------------------------------------------------

UNIFORM = [10 * MIB] * 24

GOOD = [
    # (row id, num_layers, layer_bytes, nodes, expected ranges)
    ("24 layers, 1 node", 24, UNIFORM, [node("a")], [(0, 24)]),
    ("24 layers, 2 nodes", 24, UNIFORM, [node("a"), node("b")], [(0, 12), (12, 24)]),
    ("24 layers, 3 nodes", 24, UNIFORM, [node("a"), node("b"), node("c")], [(0, 8), (8, 16), (16, 24)]),
    ("24 layers, 4 nodes", 24, UNIFORM, [node(x) for x in "abcd"], [(0, 6), (6, 12), (12, 18), (18, 24)]),
    ("as many nodes as layers", 3, [5, 5, 5], [node(x) for x in "abc"], [(0, 1), (1, 2), (2, 3)]),
    ("split follows bytes, not counts", 4, [3, 1, 1, 1], [node("a"), node("b")], [(0, 1), (1, 4)]),
    ("tie goes to the earlier cut", 5, [1] * 5, [node("a"), node("b")], [(0, 2), (2, 5)]),
    ("one heavy layer still leaves each node one", 4, [100, 1, 1, 1], [node(x) for x in "abc"],
     [(0, 1), (1, 2), (2, 4)]),
    ("weightless layers split by count", 6, [0] * 6, [node("a"), node("b")], [(0, 3), (3, 6)]),
    ("memory 1:2:3", 24, UNIFORM, [node("a", 1), node("b", 2), node("c", 3)], [(0, 4), (4, 12), (12, 24)]),
    ("memory 3:1", 24, UNIFORM, [node("a", 6), node("b", 2)], [(0, 18), (18, 24)]),
    ("memory unknown on one node: even", 24, UNIFORM, [node("a", 1), node("b"), node("c", 3)],
     [(0, 8), (8, 16), (16, 24)]),
    ("pin in the middle", 24, UNIFORM, [node("a"), node("b", pin=(10, 14)), node("c")],
     [(0, 10), (10, 14), (14, 24)]),
    ("pin at the end (design sketch)", 24, UNIFORM, [node("gpu"), node("mac", 12, pin=(14, 24))],
     [(0, 14), (14, 24)]),
    ("pins at both ends, run between", 24, UNIFORM,
     [node("a", pin=(0, 4)), node("b"), node("c"), node("d", pin=(20, 24))], [(0, 4), (4, 12), (12, 20), (20, 24)]),
    ("two runs split separately, the second evenly (c's memory unknown)", 24, UNIFORM,
     [node("a"), node("b"), node("p", pin=(8, 10)), node("c"), node("d", 1), node("e", 3)],
     [(0, 4), (4, 8), (8, 10), (10, 15), (15, 19), (19, 24)]),
    ("run split by memory between pins", 24, UNIFORM,
     [node("p", pin=(0, 4)), node("a", 1), node("b", 3), node("q", pin=(20, 24))],
     [(0, 4), (4, 8), (8, 20), (20, 24)]),
    ("all pinned", 24, UNIFORM, [node("a", pin=(0, 1)), node("b", pin=(1, 23)), node("c", pin=(23, 24))],
     [(0, 1), (1, 23), (23, 24)]),
    ("single-layer pin", 3, [1, 1, 1], [node("a"), node("b", pin=(1, 2)), node("c")], [(0, 1), (1, 2), (2, 3)]),
]


@pytest.mark.parametrize(("num_layers", "layer_bytes", "nodes", "expected"), [r[1:] for r in GOOD],
                         ids=[r[0] for r in GOOD])
def test_plans(num_layers: int, layer_bytes: list[int], nodes: list[NodeSpec],
               expected: list[tuple[int, int]]) -> None:
    plan = make_plan(num_layers, layer_bytes, nodes)
    assert ranges(plan) == expected
    assert [s.node_id for s in plan.stages] == [n.id for n in nodes]
    for stage in plan.stages:
        assert stage.weight_bytes == sum(layer_bytes[stage.start:stage.end])


# --- splits that cannot work ------------------------------------------------------------------------------

BAD = [
    # (row id, num_layers, layer_bytes, nodes, node named (or None), phrases in the message)
    ("too little memory on a pin", 24, [GIB // 7] * 24, [node("macbook", 1, pin=(0, 14)), node("pc")], "macbook",
     ["node macbook: layers 0-13 need 2.00 GiB of weights but max_memory_gb is 1", "pin fewer layers there"]),
    ("too little memory in a run", 24, [GIB // 8] * 24, [node("a", 1), node("b", 1)], "a",
     ["node a: layers 0-11 need 1.50 GiB of weights but max_memory_gb is 1 (1.00 GiB)", "add a node"]),
    ("too little memory, unknown elsewhere", 24, [GIB // 8] * 24, [node("a"), node("b", 0.1)], "b",
     ["node b: layers 12-23 need 1.50 GiB"]),
    ("more nodes than layers", 2, [1, 1], [node("a"), node("b"), node("c")], None,
     ["3 nodes", "only 2 layers", "remove 1 node"]),
    ("pin past the end", 24, UNIFORM, [node("a"), node("b", pin=(20, 31))], "b",
     ["node b: layers 20-30 go past the model's last layer 23", "24 layers"]),
    ("pin starts past the end", 24, UNIFORM, [node("a"), node("b", pin=(24, 25))], "b", ["layers 24 go past"]),
    ("gap between pins, no node", 24, UNIFORM, [node("a", pin=(0, 10)), node("b", pin=(14, 24))], "b",
     ["layers 10-13 belong to no node", "between node a (layers 0-9) and node b (layers 14-23)"]),
    ("gap at the end", 24, UNIFORM, [node("a"), node("b", pin=(8, 16))], "b",
     ["layers 16-23 belong to no node", "node b (layers 8-15) and the end of the model"]),
    ("gap at the start", 24, UNIFORM, [node("a", pin=(4, 24))], "a",
     ["layers 0-3 belong to no node", "between the start of the model and node a (layers 4-23)"]),
    ("no room for an unpinned node", 24, UNIFORM, [node("a", pin=(0, 10)), node("x"), node("b", pin=(10, 24))],
     "x", ["node(s) x sit between node a (layers 0-9) and node b (layers 10-23)", "leave 0 layer(s) for 1 node(s)"]),
    ("too little room for a run", 24, UNIFORM, [node("a", pin=(0, 22)), node("x"), node("y"), node("z")], "x",
     ["node(s) x, y, z", "leave 2 layer(s) for 3 node(s)"]),
    ("overlapping pins", 24, UNIFORM, [node("a", pin=(0, 12)), node("b", pin=(10, 24))], "b",
     ["node b: layers 10-23 overlap node a's layers 0-11"]),
    ("pins out of order", 24, UNIFORM, [node("a", pin=(12, 24)), node("b", pin=(0, 12))], "b",
     ["node b: layers 0-11 come before node a's layers 12-23"]),
    ("empty pin", 24, UNIFORM, [node("a", pin=(5, 5))], "a", ["is empty"]),
]


@pytest.mark.parametrize(("num_layers", "layer_bytes", "nodes", "node_id", "phrases"), [r[1:] for r in BAD],
                         ids=[r[0] for r in BAD])
def test_impossible_plans(num_layers: int, layer_bytes: list[int], nodes: list[NodeSpec], node_id: str | None,
                          phrases: list[str]) -> None:
    with pytest.raises(PlanError) as info:
        make_plan(num_layers, layer_bytes, nodes)
    for phrase in phrases:
        assert phrase in str(info.value)
    assert info.value.node_id == node_id
    assert "\n" not in str(info.value)


def test_no_nodes_is_a_plan_error() -> None:
    with pytest.raises(PlanError, match="no nodes"):
        make_plan(4, [1] * 4, [])


@pytest.mark.parametrize(
    ("num_layers", "layer_bytes", "nodes"),
    [(0, [], [node("a")]), (4, [1] * 3, [node("a")]), (2, [1, -1], [node("a")]), (2, [1, 1], [node("a"), node("a")])],
    ids=["no layers", "bytes length", "negative bytes", "duplicate ids"],
)
def test_misuse_is_a_value_error(num_layers: int, layer_bytes: list[int], nodes: list[NodeSpec]) -> None:
    with pytest.raises(ValueError):
        make_plan(num_layers, layer_bytes, nodes)


def test_a_split_that_overfills_a_node_gives_way_to_the_nearest_that_fits() -> None:
    """Rule 4's shares (equal where a node of the run says no memory, else by memory) may overfill a node where
    another split fits: a capped node beside an uncapped one, or nearest-share cuts rounding the wrong way. The plan
    is then the split nearest those shares that fits, where it was refused with advice that did not help."""
    quarter = GIB // 4
    plan = make_plan(24, [quarter] * 24, [node("small", 2), node("big")])
    assert ranges(plan) == [(0, 8), (8, 24)]  # 8 layers fill small's 2 GiB; equal halves overfilled it
    plan = make_plan(30, [GIB] * 30, [node("a", 27.17), node("b", 3.82)])
    assert ranges(plan) == [(0, 27), (27, 30)]  # 26/4 by memory's share put 4 GiB on b
    plan = make_plan(24, [quarter] * 24, [node("a"), node("small", 1), node("c")])
    assert ranges(plan) == [(0, 10), (10, 14), (14, 24)]  # small's shortfall shared by the cuts on either side
    assert ranges(make_plan(24, [quarter] * 24, [node("a", 4), node("b")])) == [(0, 12), (12, 24)]  # it fits: as ever


@settings(max_examples=300, deadline=None)
@given(st.integers(2, 10).flatmap(lambda n: st.tuples(
    st.lists(st.integers(1, 100), min_size=n, max_size=n),
    st.lists(st.none() | st.integers(1, 400), min_size=1, max_size=min(n, 4)))))
def test_property_a_run_is_refused_for_memory_only_where_no_split_fits(case) -> None:
    import itertools

    layer_bytes, caps = case
    nodes = [NodeSpec(f"n{i}", "cpu", "fp32", cap, None) for i, cap in enumerate(caps)]
    fits = any(all(cap is None or sum(layer_bytes[a:b]) <= cap for cap, a, b in zip(caps, bounds, bounds[1:]))
               for cuts in itertools.combinations(range(1, len(layer_bytes)), len(caps) - 1)
               for bounds in [(0, *cuts, len(layer_bytes))])
    try:
        make_plan(len(layer_bytes), layer_bytes, nodes)
    except PlanError as exc:
        assert not fits and "max_memory_gb" in str(exc)
        return
    assert fits


def test_memory_exactly_full_fits() -> None:
    plan = make_plan(2, [GIB, GIB], [node("a", 1), node("b", 1)])
    assert [s.headroom_bytes for s in plan.stages] == [0, 0]


# --- the plan value -------------------------------------------------------------------------------------


def test_stage_for_headroom_and_table() -> None:
    nodes = [node("gpu-box", 8, device="cuda:0", dtype="bf16"), node("macbook", pin=(16, 24), device="mps",
                                                                       dtype="fp16")]
    plan = make_plan(24, [100 * MIB] * 24, nodes)
    gpu = plan.stage_for("gpu-box")
    assert (gpu.start, gpu.end, gpu.layer_count, gpu.layers_text) == (0, 16, 16, "0-15")
    assert gpu.headroom_bytes == 8 * GIB - 1600 * MIB
    assert plan.stage_for("macbook").headroom_bytes is None
    assert plan.total_weight_bytes == 2400 * MIB
    with pytest.raises(KeyError, match="gpu-box, macbook"):
        plan.stage_for("cpu-box")

    lines = plan.table().splitlines()
    assert lines[0].split() == ["node", "device", "dtype", "layers", "count", "weights", "memory", "headroom"]
    assert lines[1].split() == ["gpu-box", "cuda:0", "bf16", "0-15", "16", "1.56", "GiB", "8.00", "GiB", "6.44", "GiB"]
    assert lines[2].split() == ["macbook", "mps", "fp16", "16-23", "8", "800.0", "MiB", "-", "-"]
    assert lines[3].split() == ["total", "0-23", "24", "2.34", "GiB"]
    # Fixed width: every column starts at the same offset on every row.
    assert lines[1].index("cuda:0") == lines[2].index("mps") == lines[0].index("device")


def test_table_names_every_node() -> None:
    nodes = [node(f"node-{i}") for i in range(7)]
    table = make_plan(30, [1] * 30, nodes).table()
    for spec in nodes:
        assert spec.id in table


@pytest.mark.parametrize(
    ("count", "text"),
    [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (10 * MIB, "10.0 MiB"), (3 * GIB // 2, "1.50 GiB"),
     (-2 * GIB, "-2.00 GiB")],
)
def test_format_bytes(count: int, text: str) -> None:
    assert format_bytes(count) == text


def test_stage_is_frozen() -> None:
    stage = Stage("a", "cpu", "fp32", 0, 1, 10, None)
    with pytest.raises(AttributeError):
        stage.start = 3  # type: ignore[misc]


# --- per-layer bytes -----------------------------------------------------------------------------------

H, I, KV = 896, 4864, 128  # Qwen2.5-0.5B: hidden, intermediate, 2 KV heads x 64
QWEN_LAYER = [
    ("self_attn.q_proj.weight", (H, H), 2), ("self_attn.k_proj.weight", (KV, H), 2),
    ("self_attn.v_proj.weight", (KV, H), 2), ("self_attn.o_proj.weight", (H, H), 2),
    ("mlp.gate_proj.weight", (I, H), 2), ("mlp.up_proj.weight", (I, H), 2), ("mlp.down_proj.weight", (H, I), 2),
    ("self_attn.q_proj.bias", (H,), 2), ("self_attn.k_proj.bias", (KV,), 2), ("self_attn.v_proj.bias", (KV,), 2),
    ("input_layernorm.weight", (H,), 2), ("post_attention_layernorm.weight", (H,), 2),
]


@pytest.mark.parametrize(
    ("quant", "expected"),
    # Worked by hand: fp16 2 B/weight; int8 1 B/weight + 4 B/row; int4 0.5 B/weight + 4 B/(row, group of 128);
    # plus the 1-D tensors (3 biases + 2 norms = 2944 elements) at 2 B each.
    [("fp16", 29_824_768), ("int8", 14_966_016), ("int4", 7_926_528)],
)
def test_layer_weight_bytes_qwen_layer(quant: str, expected: int) -> None:
    assert layer_weight_bytes([QWEN_LAYER, QWEN_LAYER], quant, 128) == [expected, expected]


def test_layer_weight_bytes_counts_only_2d_proj_weights_as_quantized() -> None:
    layer = [
        ("mlp.up_proj.weight", (4, 256), 4),       # quantized: 4*256 + 4*4 in int8
        ("some_other.weight", (4, 256), 4),         # 2-D but not a projection: 16-bit
        ("self_attn.q_proj.bias", (4,), 4),         # fp32 in the checkpoint, 16-bit in memory
    ]
    assert layer_weight_bytes([layer], "int8", 128) == [4 * 256 + 16 + 4 * 256 * 2 + 4 * 2]
    assert layer_weight_bytes([[]], "int8", 128) == [0]


def test_layer_weight_bytes_group_size_matters() -> None:
    layer = [("mlp.down_proj.weight", (2, 256), 2)]
    assert layer_weight_bytes([layer], "int4", 128) == [256 + 2 * 2 * 4]
    assert layer_weight_bytes([layer], "int4", 32) == [256 + 2 * 8 * 4]


def test_layer_weight_bytes_refuses_unknown_mode() -> None:
    with pytest.raises(ValueError, match="int3"):
        layer_weight_bytes([[("input_layernorm.weight", (8,), 2)]], "int3", 128)


# --- from the topology -----------------------------------------------------------------------------------


def test_node_specs_from_topology(tmp_path: Path) -> None:
    topo = parse_topology(
        {
            "model": "a/b", "quant": "fp16", "dtype": "bf16",
            "head": {"api": "127.0.0.1:8000", "listen": "127.0.0.1:7001"},
            "nodes": [
                {"id": "gpu", "device": "cuda:1"},
                {"id": "mac", "device": "mps", "dtype": "fp16", "max_memory_gb": 1.5, "layers": "10-23"},
            ],
        },
        tmp_path,
    )
    assert node_specs(topo) == [
        NodeSpec("gpu", "cuda:1", "bf16", None, None),
        NodeSpec("mac", "mps", "fp16", 3 * GIB // 2, (10, 24)),
    ]


def test_example_topology_plans_qwen_05b() -> None:
    topo = load_topology(REPO_ROOT / "topology.example.yaml")
    per_layer = layer_weight_bytes([QWEN_LAYER] * 24, topo.quant, topo.group_size)
    plan = make_plan(24, per_layer, node_specs(topo))
    assert [(s.node_id, s.layers_text) for s in plan.stages] == [
        ("gpu-box", "0-11"), ("macbook", "12-19"), ("cpu-box", "20-23"),
    ]
    assert all(s.headroom_bytes is None or s.headroom_bytes > 0 for s in plan.stages)


# --- the property: any plan covers [0, num_layers) contiguously in node order ---------------------------


def check_plan(plan: Plan, num_layers: int, layer_bytes: list[int], nodes: list[NodeSpec]) -> None:
    assert plan.num_layers == num_layers
    assert [s.node_id for s in plan.stages] == [n.id for n in nodes]
    cursor = 0
    for stage, spec in zip(plan.stages, nodes):
        assert stage.start == cursor and stage.end > stage.start
        cursor = stage.end
        assert stage.weight_bytes == sum(layer_bytes[stage.start:stage.end])
        if spec.pin is not None:
            assert (stage.start, stage.end) == spec.pin
        if spec.memory_bytes is not None:
            assert stage.weight_bytes <= spec.memory_bytes
        assert (stage.device, stage.dtype, stage.memory_bytes) == (spec.device, spec.dtype, spec.memory_bytes)
    assert cursor == num_layers


@st.composite
def feasible_layouts(draw: st.DrawFn) -> tuple[int, list[int], list[NodeSpec]]:
    """Random models and node lists whose pins always leave each gap fillable."""
    num_layers = draw(st.integers(1, 64))
    layer_bytes = draw(st.lists(st.integers(0, 10**9), min_size=num_layers, max_size=num_layers))
    count = draw(st.integers(1, min(num_layers, 10)))
    cuts = sorted(draw(st.sets(st.integers(1, num_layers - 1), min_size=count - 1, max_size=count - 1))) \
        if count > 1 else []
    bounds = [0, *cuts, num_layers]
    total = sum(layer_bytes)
    nodes = []
    for i in range(count):
        pinned = draw(st.booleans())
        # Memory around a fair share of the bytes, so that both fitting and not fitting come up often.
        percent = draw(st.none() | st.integers(1, 300))
        memory = None if percent is None else max(1, total * percent // (100 * count))
        nodes.append(NodeSpec(f"n{i}", "cpu", "fp32", memory, (bounds[i], bounds[i + 1]) if pinned else None))
    return num_layers, layer_bytes, nodes


@settings(max_examples=200, deadline=None)
@given(feasible_layouts())
def test_property_feasible_pins_always_plan_or_fail_on_memory(
    layout: tuple[int, list[int], list[NodeSpec]],
) -> None:
    num_layers, layer_bytes, nodes = layout
    try:
        plan = make_plan(num_layers, layer_bytes, nodes)
    except PlanError as exc:
        assert "max_memory_gb" in str(exc)  # the pins are fillable, so only memory can be short
        assert any(n.memory_bytes is not None for n in nodes)
        return
    check_plan(plan, num_layers, layer_bytes, nodes)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 40).flatmap(lambda n: st.tuples(
        st.just(n),
        st.lists(st.integers(0, 10**6), min_size=n, max_size=n),
        st.lists(st.tuples(st.none() | st.integers(1, 4 * 10**7),
                           st.none() | st.tuples(st.integers(-1, n + 1), st.integers(0, n + 2))),
                 min_size=1, max_size=12),
    ))
)
def test_property_any_input_gives_a_covering_plan_or_plan_error(
    case: tuple[int, list[int], list[tuple[int | None, tuple[int, int] | None]]],
) -> None:
    num_layers, layer_bytes, raw = case
    nodes = [NodeSpec(f"n{i}", "cpu", "fp32", memory, pin) for i, (memory, pin) in enumerate(raw)]
    try:
        plan = make_plan(num_layers, layer_bytes, nodes)
    except PlanError:
        return
    check_plan(plan, num_layers, layer_bytes, nodes)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 64).flatmap(lambda n: st.tuples(st.just(n), st.integers(1, n))))
def test_property_uniform_even_split_differs_by_at_most_one_layer(case: tuple[int, int]) -> None:
    num_layers, count = case
    plan = make_plan(num_layers, [7] * num_layers, [node(f"n{i}") for i in range(count)])
    sizes = [s.layer_count for s in plan.stages]
    assert max(sizes) - min(sizes) <= 1
