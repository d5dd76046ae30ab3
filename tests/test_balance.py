"""The time-balancing planner and its forecast, over synthetic capability sets (no measurement here)."""
from __future__ import annotations

import itertools
import random

import pytest

from tc.balance import Runner, slowest_stage_bound, split_by_time
from tc.forecast import HeadCost, forecast, explain
from tc.planner import NodeSpec, PlanError, make_plan
from tc.speed import LinkSpeed, Speed

MB = 1_000_000
LAYERS = [30 * MB] * 24  # a 0.5B-class model in 16 bits: 24 layers of 30 MB
CPU = Speed(decode_bytes_per_s=10e9, prefill_bytes_per_s=200e9, layer_overhead_s=0.5e-3)
CUDA = Speed(decode_bytes_per_s=100e9, prefill_bytes_per_s=20e12, layer_overhead_s=0.05e-3)  # 10x the CPU
MAC = Speed(decode_bytes_per_s=60e9, prefill_bytes_per_s=5e12, layer_overhead_s=0.1e-3)


def node(node_id: str, speed: Speed | None, memory: int | None = None, pin: tuple[int, int] | None = None,
         link: LinkSpeed | None = None) -> NodeSpec:
    return NodeSpec(node_id, "cpu", "bf16", memory, pin, speed, link)


def stage_times(plan) -> list[float]:
    return [stage.decode_s for stage in plan.stages]


def test_without_speeds_the_split_is_todays():
    nodes = [node("a", None), node("b", None), node("c", None)]
    assert [(s.start, s.end) for s in make_plan(24, LAYERS, nodes).stages] == [(0, 8), (8, 16), (16, 24)]


def test_equal_speeds_give_the_even_split():
    plan = make_plan(24, LAYERS, [node("a", CPU), node("b", CPU), node("c", CPU)])
    assert [s.layer_count for s in plan.stages] == [8, 8, 8]


def test_cuda_ten_times_faster_takes_most_layers():
    even = make_plan(24, LAYERS, [node("cpu", None), node("gpu", None)])
    plan = make_plan(24, LAYERS, [node("cpu", CPU), node("gpu", CUDA)])
    assert [s.layer_count for s in plan.stages] == [2, 22]
    times = stage_times(plan)
    even_times = [CPU.decode_s(even.stages[0].weight_bytes, 12), CUDA.decode_s(even.stages[1].weight_bytes, 12)]
    assert max(times) < max(even_times) / 4 and sum(times) < sum(even_times) / 3


def test_a_mac_with_little_memory_gets_no_more_than_fits():
    # the Mac is fast but holds only 3 layers; the CPU must take the rest beside the GPU
    gpu_memory = 16 * 30 * MB
    nodes = [node("gpu", CUDA, memory=gpu_memory), node("mac", MAC, memory=3 * 30 * MB + 1), node("cpu", CPU)]
    plan = make_plan(24, LAYERS, nodes)
    counts = [s.layer_count for s in plan.stages]
    assert counts == [16, 3, 5]  # gpu and mac full; the slow CPU takes only what is left
    assert all(s.weight_bytes <= s.memory_bytes for s in plan.stages if s.memory_bytes is not None)


def test_pins_are_kept_and_the_rest_balanced_around_them():
    nodes = [node("cpu", CPU), node("mac", MAC, pin=(10, 14)), node("gpu", CUDA), node("cpu2", CPU)]
    plan = make_plan(24, LAYERS, nodes)
    assert (plan.stages[1].start, plan.stages[1].end) == (10, 14)
    assert plan.stages[0].layer_count == 10  # alone before the pin: it has to take them all
    # the first CPU's 10 layers bound the slowest stage anyway, so after the pin the GPU takes all but the one
    # layer cpu2 must hold: that leaves the slowest stage as it is and makes the sum least
    assert [s.layer_count for s in plan.stages[2:]] == [9, 1]
    assert max(stage_times(plan)) == plan.stages[0].decode_s


def test_a_run_without_every_speed_falls_back_to_bytes():
    plan = make_plan(24, LAYERS, [node("a", CPU), node("b", None)])
    assert [s.layer_count for s in plan.stages] == [12, 12]


def test_memory_too_small_for_any_split_still_names_the_node_that_overflows():
    with pytest.raises(PlanError, match="node a: layers 0-11 need"):
        make_plan(24, LAYERS, [node("a", CUDA, memory=10 * 30 * MB), node("b", CPU, memory=10 * 30 * MB)])


def _brute(layer_bytes, runners):
    """Every contiguous split, scored as the balancer scores: (slowest stage, then total)."""
    best = None
    n = len(layer_bytes)
    for cuts in itertools.combinations(range(1, n), len(runners) - 1):
        bounds = [0, *cuts, n]
        times = []
        for r, (a, b) in zip(runners, zip(bounds, bounds[1:])):
            nbytes = sum(layer_bytes[a:b])
            if r.memory_bytes is not None and nbytes > r.memory_bytes:
                break
            times.append(r.speed.decode_s(nbytes, b - a))
        else:
            score = (max(times), sum(times))
            best = score if best is None or score < best else best
    return best


def test_the_split_is_optimal_against_brute_force():
    rng = random.Random(7)
    for _ in range(60):
        layers = [rng.randint(1, 50) * MB for _ in range(rng.randint(3, 9))]
        runners = [Runner(Speed(rng.uniform(1e9, 50e9), 1e12, rng.uniform(0, 2e-3)),
                          rng.choice([None, rng.randint(40, 200) * MB]))
                   for _ in range(rng.randint(1, min(4, len(layers))))]
        expected = _brute(layers, runners)
        split = split_by_time(layers, runners)
        if expected is None:
            assert split is None and slowest_stage_bound(layers, runners) == float("inf")
            continue
        times = [r.speed.decode_s(sum(layers[a:b]), b - a) for r, (a, b) in zip(runners, split)]
        assert max(times) == pytest.approx(expected[0], rel=1e-9)
        assert sum(times) == pytest.approx(expected[1], rel=1e-6)


def test_forecast_adds_head_stages_and_hops_and_names_a_slow_link():
    slow_link = LinkSpeed(round_trip_s=0.050, bytes_per_s=1e6)  # 50 ms over a congested uplink
    fast_link = LinkSpeed(round_trip_s=0.0002, bytes_per_s=1e9)
    plan = make_plan(24, LAYERS, [node("gpu", CUDA, link=fast_link), node("far", CUDA, link=slow_link)])
    head = HeadCost(weight_bytes=272 * MB, speed=CPU)
    prediction = forecast(plan, hop_bytes_per_position=896 * 2, head=head, prefill_positions=128)
    stage_s = sum(stage_times(plan))
    hops = fast_link.hop_s(1792) + slow_link.hop_s(1792)
    assert prediction.decode_token_s == pytest.approx(head.decode_s + stage_s + hops)
    assert prediction.decode_tokens_per_s == pytest.approx(1 / (head.decode_s + stage_s + hops))
    assert prediction.bottleneck()[0] == "link to far"
    assert "link to far" in prediction.advice() and "network" in prediction.advice()
    text = explain(plan, prediction)
    assert "predicted: decode" in text and "to improve:" in text and "far" in text


def test_with_direct_hops_each_stage_but_the_last_takes_one_way_of_its_link():
    """head -> a -> b -> head: the way into a and into b, one transfer each, and b's way back."""
    link_a = LinkSpeed(round_trip_s=0.004, bytes_per_s=1e8)
    link_b = LinkSpeed(round_trip_s=0.010, bytes_per_s=1e7)
    plan = make_plan(24, LAYERS, [node("a", CUDA, link=link_a), node("b", CUDA, link=link_b)])
    head = HeadCost(weight_bytes=272 * MB, speed=CPU)
    relayed = forecast(plan, 1792, head, prefill_positions=128)
    direct = forecast(plan, 1792, head, prefill_positions=128, direct_hops=True)
    assert [s.hop_decode_s for s in direct.stages] == [link_a.hop_s(1792) / 2, link_b.hop_s(1792)]
    assert direct.decode_token_s == pytest.approx(relayed.decode_token_s - link_a.hop_s(1792) / 2)
    assert direct.stages[0].hop_prefill_s == pytest.approx(link_a.hop_s(1792 * 128) / 2)
    single = make_plan(24, LAYERS, [node("a", CUDA, link=link_a)])  # one stage: there and back either way
    assert forecast(single, 1792, head, direct_hops=True).decode_token_s == forecast(single, 1792, head).decode_token_s


def test_forecast_names_the_slowest_node_and_its_share():
    plan = make_plan(24, LAYERS, [node("cpu", CPU, pin=(0, 12)), node("gpu", CUDA)])
    prediction = forecast(plan, 1792, HeadCost(1 * MB, CUDA))
    name, share = prediction.bottleneck()
    assert name == "node cpu" and share > 0.8
    assert prediction.advice().startswith(f"node cpu holds {share * 100:.0f}% of the time: pin fewer layers")
    balanced = forecast(make_plan(24, LAYERS, [node("cpu", CPU), node("gpu", CUDA)]), 1792, HeadCost(1 * MB, CUDA))
    assert "no more layers than its speed allows" in balanced.advice()


def test_forecast_without_speeds_says_what_is_missing():
    plan = make_plan(24, LAYERS, [node("a", None), node("b", CPU)])
    prediction = forecast(plan, 1792, None)
    assert prediction.decode_tokens_per_s is None and prediction.bottleneck() is None
    assert "no speed known for a" in prediction.advice()
    assert "needs every node's speed" in explain(plan, prediction)


def test_plan_explain_prints_the_timed_table(tmp_path, capsys):
    """`tc plan --explain` on a real (tiny) model directory, with every speed from the topology."""
    from tc.cli import main
    from cluster import write_topology
    from tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path / "model")
    fast = {"decode_gbps": 50, "prefill_gbps": 5000, "layer_ms": 0.05}
    slow = {"decode_gbps": 0.005, "prefill_gbps": 0.5, "layer_ms": 2}  # the tiny model's layers are small
    topology = write_topology(tmp_path / "topology.yaml", model, [
        {"id": "slow", "device": "cpu", "speed": slow}, {"id": "fast", "device": "cpu", "speed": fast},
    ], head={"speed": fast})
    assert main(["plan", "--explain", str(topology)]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("slow ", "fast "))}
    assert int(rows["slow"][4]) < int(rows["fast"][4])  # the slow node holds fewer layers
    assert "predicted: decode" in out and "tokens/s" in out and "to improve: node slow holds" in out
    assert main(["plan", str(topology)]) == 0  # without --explain: today's table
    assert "decode ms" not in capsys.readouterr().out


def test_plan_notes_the_cpu_nodes_that_compute_fp16_in_fp32(tmp_path, capsys):
    """The table gives the dtype a node asks for; a CPU computes fp16 in fp32 (and its caches are counted so), which
    its worker says only at its load: `tc plan` says it at once, naming those nodes, and nothing where none do."""
    from tc.cli import main
    from cluster import write_topology
    from tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path / "model")
    topology = write_topology(tmp_path / "topology.yaml", model, [
        {"id": "a", "device": "cpu", "dtype": "fp16"}, {"id": "b", "device": "cpu"}], dtype="bf16")
    assert main(["plan", str(topology)]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert notes == ["note: a (cpu, fp16) computes in fp32: CPUs have no fast fp16, and their KV caches above are "
                     "counted in fp32; dtype: bf16 is the fast choice on a CPU"]
    topology = write_topology(tmp_path / "topology.yaml", model, [{"id": "a", "device": "cpu"}], dtype="bf16")
    assert main(["plan", str(topology)]) == 0
    assert "note:" not in capsys.readouterr().out


def test_advice_offers_only_weight_modes_smaller_than_the_one_in_use():
    """A topology already in int8 is told of int4 alone, one in int4 of no mode at all; the head's lm_head stays
    int8 under int4, so only an fp16 head is told to quantize."""
    pinned = make_plan(24, LAYERS, [node("cpu", CPU, pin=(0, 12)), node("gpu", CUDA)])
    balanced = make_plan(24, LAYERS, [node("cpu", CPU), node("gpu", CUDA)])
    for plan in (pinned, balanced):
        assert "(quant: int8 or int4)" in forecast(plan, 1792, HeadCost(1 * MB, CUDA)).advice()
        int8 = forecast(plan, 1792, HeadCost(1 * MB, CUDA), quant="int8").advice()
        assert "quantize (quant: int4)" in int8 and "int8 or" not in int8
        assert "quant" not in forecast(plan, 1792, HeadCost(1 * MB, CUDA), quant="int4").advice()
    head_bound = make_plan(24, LAYERS, [node("gpu", CUDA)])
    slow_head = HeadCost(2000 * MB, CPU)
    assert forecast(head_bound, 1792, slow_head).bottleneck()[0] == "head"
    assert "quantize" in forecast(head_bound, 1792, slow_head).advice()
    for mode in ("int8", "int4"):
        assert "quant" not in forecast(head_bound, 1792, slow_head, quant=mode).advice()


def test_plan_explain_advice_follows_the_topology(tmp_path, capsys):
    """`tc plan --explain` advises from the topology's weight mode and plan source: a plan from the topology never
    takes the workers' measurements, so starting them would not make the split follow speed."""
    from tc.cli import main
    from cluster import write_topology
    from tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path / "model")
    fast = {"decode_gbps": 50, "prefill_gbps": 5000, "layer_ms": 0.05}
    slow = {"decode_gbps": 0.005, "prefill_gbps": 0.5, "layer_ms": 2}
    timed = write_topology(tmp_path / "timed.yaml", model, [
        {"id": "slow", "device": "cpu", "speed": slow}, {"id": "fast", "device": "cpu", "speed": fast},
    ], head={"speed": fast}, quant="int8")
    assert main(["plan", "--explain", str(timed)]) == 0
    advice = [line for line in capsys.readouterr().out.splitlines() if line.startswith("to improve:")]
    assert advice and "node slow holds" in advice[0] and "quantize (quant: int4)" in advice[0], advice
    assert "int8 or int4" not in advice[0]
    untimed = write_topology(tmp_path / "untimed.yaml", model, [{"id": "a", "device": "cpu"}], head={"speed": fast})
    assert main(["plan", "--explain", str(untimed)]) == 0
    out = capsys.readouterr().out
    assert "no speed known for a: set head.plan_from: workers" in out and "start their workers" not in out
    waiting = write_topology(tmp_path / "waiting.yaml", model, [{"id": "a", "device": "cpu"}],
                             head={"speed": fast, "plan_from": "workers"})
    assert main(["plan", "--explain", str(waiting)]) == 0
    assert "no speed known for a: start their workers" in capsys.readouterr().out
