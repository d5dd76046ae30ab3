"""The CUDA and MPS code paths, checked on the CPU: each device decision is a pure function of the device facts,
tested by table, and each fallback it can choose is forced here and compared with the path it replaces."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from model_helpers import OurModel
from tc.generation import LocalPipeline
from tc.model.config import Qwen2Config
from tc.model.quant import (QuantizationError, dequantize_int4, int8_device_speed_probe, int8_kernel_shape_ok,
                            int8_paths_by_speed, Quantization, quantize_int4, quantized_nbytes)
from tc.model.qwen2 import (Attention, compute_dtype_name, cuda_capability_has_bf16, grouped_attention,
                            must_expand_kv_heads, sdpa_has_enable_gqa, torch_release, Stage)
from tc.model.weights import WeightIndex
from tc.worker.device import DeviceError, compute_dtypes, cuda_devices, detect_devices, select_device

IDS = [5, 17, 250, 3, 99, 42, 7, 128, 64, 31, 200, 11]


# ---------------------------------------------------------------------------------------- SDPA and GQA


@pytest.mark.parametrize("device_type, has_gqa, release, expand", [
    ("cpu", True, (2, 13), False),
    ("cuda", True, (2, 5), False),
    ("cpu", False, (2, 4), True),  # torch 2.4: SDPA has no enable_gqa
    ("cuda", False, (2, 4), True),
    ("mps", False, (2, 4), True),
    ("mps", True, (2, 5), True),  # pytorch issue 149132: enable_gqa on MPS aborts the process
    ("mps", True, (2, 6), True),
    ("mps", True, (2, 7), False),
    ("mps", True, (3, 0), False),
])
def test_when_the_kv_heads_are_expanded(device_type, has_gqa, release, expand):
    assert must_expand_kv_heads(device_type, has_gqa, release) is expand


@pytest.mark.parametrize("version, release", [("2.4.1", (2, 4)), ("2.6.0+cu124", (2, 6)),
                                              ("2.7.0.dev20250311", (2, 7)), ("2.13.0+cpu", (2, 13))])
def test_torch_release(version, release):
    assert torch_release(version) == release


def test_this_torch_has_enable_gqa():
    # the installed torch (>= 2.5) has it; the probe must say so, or every prefill would pay for a copy
    assert sdpa_has_enable_gqa() is True


@pytest.mark.parametrize("mask_kind", ["causal", "mask"])
def test_expanded_kv_heads_give_what_enable_gqa_gives(mask_kind):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 14, 9, 64, generator=g)  # [B, H, L, D]
    k = torch.randn(1, 2, 13, 64, generator=g)  # [B, H_kv, T, D]
    v = torch.randn(1, 2, 13, 64, generator=g)
    if mask_kind == "causal":
        q, k, v, mask, causal = q, k[:, :, :9], v[:, :, :9], None, True
    else:
        mask, causal = torch.arange(13)[None, :] <= torch.arange(4, 13)[:, None], False  # [L, T]
    fast = grouped_attention(q, k, v, mask, causal, expand_kv=False)
    fallback = grouped_attention(q, k, v, mask, causal, expand_kv=True)
    torch.testing.assert_close(fallback, fast, rtol=1e-5, atol=1e-6)


def test_a_model_forced_onto_the_expanded_path_matches_the_fast_one(tiny_model_dir, monkeypatch):
    model = OurModel(tiny_model_dir)
    fast = model.cached_logits(IDS, 5)  # a prefill from 0, then decode steps
    chunked_fast = _two_chunk_hidden(model)
    monkeypatch.setattr(Attention, "expand_kv", True)
    expanded = model.cached_logits(IDS, 5)
    chunked_expanded = _two_chunk_hidden(model)
    torch.testing.assert_close(expanded, fast, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked_expanded, chunked_fast, rtol=1e-5, atol=1e-5)


def _two_chunk_hidden(model: OurModel) -> torch.Tensor:
    """Final hidden states of a prefill in two chunks, the second at position_start > 0 (the masked SDPA call)."""
    pipe = model.pipeline()
    pipe.prefill(model.head.embed(torch.tensor([IDS[:4]])), capacity=len(IDS))
    return pipe.decode(model.head.embed(torch.tensor([IDS[4:]])), 4)  # 8 positions at once, from position 4


# ------------------------------------------------------------------------------------------- bf16 facts


@pytest.mark.parametrize("capability, native", [
    ((6, 0), False),  # Pascal P100
    ((6, 1), False),
    ((7, 0), False),  # V100
    ((7, 5), False),  # T4, whose torch.cuda.is_bf16_supported() says True (emulated)
    ((8, 0), True),  # A100
    ((8, 6), True),
    ((8, 9), True),  # L4, RTX 4090
    ((9, 0), True),  # H100
    ((10, 0), True),
])
def test_cuda_bf16_follows_the_compute_capability(capability, native):
    assert cuda_capability_has_bf16(capability) is native


@pytest.mark.parametrize("dtype, name", [(torch.float32, "fp32"), (torch.bfloat16, "bf16"), (torch.float16, "fp16")])
def test_compute_dtype_names(dtype, name):
    assert compute_dtype_name(dtype) == name


def test_compute_dtype_name_refuses_other_dtypes():
    with pytest.raises(ValueError, match="not a compute dtype"):
        compute_dtype_name(torch.float64)


# ------------------------------------------------------------------------------------------ device facts


def test_only_the_selected_gpu_is_asked_for_its_free_memory():
    asked: list[int] = []

    def free_memory(i: int) -> int:
        asked.append(i)
        return (i + 1) * 1000

    devices = cuda_devices(4, lambda i: (f"GPU {i}", 80_000), free_memory, selected="cuda:2")
    assert asked == [2]  # each query would create a CUDA context on that GPU
    assert [(d.id, d.name, d.total_memory, d.free_memory) for d in devices] == [
        ("cuda:0", "GPU 0", 80_000, None), ("cuda:1", "GPU 1", 80_000, None),
        ("cuda:2", "GPU 2", 80_000, 3000), ("cuda:3", "GPU 3", 80_000, None)]
    assert cuda_devices(2, lambda i: ("GPU", 1), free_memory, selected="cpu")[0].free_memory is None
    assert asked == [2]


def test_the_cpu_devices_of_this_machine():
    devices = detect_devices(selected="cpu")
    assert devices[-1].id == "cpu" and devices[-1].total_memory
    assert compute_dtypes("cpu") == ("bf16", "fp32")


def _memory_cgroup_dir():
    """A new child of this machine's memory cgroup, and the file its limit goes in: v1's memory controller, or v2
    where the memory controller is given to children. None where this process cannot make one."""
    import os
    from pathlib import Path

    name = f"tc-test-{os.getpid()}"
    v1, v2 = Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")
    candidates = []
    if (v1 / "memory.limit_in_bytes").is_file():
        candidates.append((v1, "memory.limit_in_bytes"))
    try:
        if "memory" in (v2 / "cgroup.subtree_control").read_text().split():
            candidates.append((v2, "memory.max"))
    except OSError:
        pass
    for parent, limit_file in candidates:
        try:
            (parent / name).mkdir()
        except OSError:
            continue
        return parent / name, limit_file
    return None


def test_a_worker_in_a_memory_cgroup_offers_its_limit_not_the_machine_s():
    """A worker in a container limited to a few GiB on a larger machine offered the machine's memory (read from
    /proc/meminfo), which the head then planned layers into, until the kernel killed the worker mid-load without a
    word. A real memory cgroup with a 3 GiB limit and a real worker process's view of its CPU device."""
    import subprocess
    import sys

    from tc.worker.device import _cpu_memory

    made = _memory_cgroup_dir()
    if made is None:
        pytest.skip("this process cannot make a memory cgroup (needs root and a writable cgroup mount)")
    group, limit_file = made
    limit = 3 << 30
    here = _cpu_memory()[0]  # this machine's, within the cgroups this test runs in: the new one's limit below it
    if here is None or here <= limit:
        group.rmdir()
        pytest.skip(f"this process may use {here} bytes, not more than the {limit} the test limits a worker to")
    try:
        (group / limit_file).write_text(str(limit))
        script = ("import logging; logging.basicConfig(level=logging.INFO); from tc.worker.device import "
                  "detect_devices; cpu = detect_devices('cpu')[-1]; print(cpu.total_memory, cpu.free_memory)")
        done = subprocess.run(["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$0" -c "$1"', sys.executable,
                               script], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        total, free = map(int, done.stdout.split())
        assert total == limit and 0 < free <= limit, done.stdout
        assert "this process's memory cgroup allows 3.0 GiB" in done.stderr
    finally:
        group.rmdir()


def test_a_v2_memory_cgroup_is_read_up_to_its_tightest_limit(tmp_path):
    """cgroup v2's files (memory.max up the tree, memory.current, memory.stat's inactive_file), as a v2 machine
    lays them out, read as v1's are."""
    from tc.worker.device import cgroup_memory

    root = tmp_path / "cgroup"
    leaf = root / "system.slice" / "tc.service"
    leaf.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu memory\n")
    (root / "system.slice" / "memory.max").write_text(f"{4 << 30}\n")
    (leaf / "memory.max").write_text("max\n")
    (root / "system.slice" / "memory.current").write_text(f"{1 << 30}\n")
    (root / "system.slice" / "memory.stat").write_text(
        f"anon 1\ninactive_file {256 << 20}\nactive_file {128 << 20}\nshmem 3\n")
    proc = tmp_path / "cgroup-of-self"
    proc.write_text("0::/system.slice/tc.service\n")
    # the page cache (a model read before) counts as free, as MemAvailable counts it
    assert cgroup_memory(proc, root) == (4 << 30, (4 << 30) - (1 << 30) + (384 << 20))
    (root / "system.slice" / "memory.max").write_text("max\n")
    assert cgroup_memory(proc, root) is None  # no limit anywhere: the machine's figures
    proc.write_text("0::/elsewhere\n")  # a cgroup namespace's own "/" or a path not mounted here: from the root
    assert cgroup_memory(proc, root) is None


def test_a_worker_s_device_is_chosen_or_refused_in_words_that_say_what_to_do(monkeypatch):
    """--device takes what the topology's device takes, and refuses what is no device in the same words; a CUDA
    device asked of a PyTorch built without CUDA (its CPU-only wheel on a GPU box) says so and what to install."""
    cpu_only = detect_devices(selected="cpu")[-1:]
    assert select_device("auto", cpu_only) == select_device("cpu", cpu_only) == "cpu"
    with pytest.raises(DeviceError, match="'gpu' is not a device; use auto, cpu, cuda, cuda:N or mps"):
        select_device("gpu", cpu_only)
    with pytest.raises(DeviceError, match=r"device 'mps' is not available on this machine \(it has: cpu\)$"):
        select_device("mps", cpu_only)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    with pytest.raises(DeviceError, match=r"'cuda:0' is not available .*: this PyTorch \(.*\) is built without "
                                          "CUDA; pip uninstall torch, then install a CUDA build"):
        select_device("cuda", cpu_only)
    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)  # ROCm's builds answer to "cuda" too
    with pytest.raises(DeviceError, match=r"device 'cuda:0' is not available on this machine \(it has: cpu\)$"):
        select_device("cuda", cpu_only)
    monkeypatch.setattr(torch.version, "cuda", "12.8")  # a CUDA build that finds no GPU: no word on the build
    with pytest.raises(DeviceError, match=r"device 'cuda:1' is not available on this machine \(it has: cpu\)$"):
        select_device("cuda:1", cpu_only)


# ------------------------------------------------------------------ quantization without bf16 (older macOS)


class DtypesSeen(TorchDispatchMode):
    """Records the dtype of every tensor each op takes or makes: what a device would be asked to hold."""

    def __init__(self):
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves((args, kwargs, out)):
            if isinstance(t, torch.Tensor):
                self.dtypes.add(t.dtype)
        return out


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_with_fp16_scales_keeps_every_weight_within_half_a_step(group_size):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 200, generator=g) * 0.05 + 0.01  # 200: the last group is padded
    qw = quantize_int4(w, group_size, torch.float16)
    assert qw.scales.dtype == qw.zeros.dtype == torch.float16
    step = qw.scales.float().repeat_interleave(group_size, dim=1)[:, :200]  # [out, in]
    assert ((dequantize_int4(qw) - w).abs() <= step / 2 * (1 + 1e-3) + 1e-7).all()
    assert quantized_nbytes((48, 200), "int4", group_size) == \
        qw.packed.numel() + 2 * 2 * qw.scales.numel()  # the same bytes as bf16 scales


def test_int4_refuses_scale_dtypes_the_kernels_and_sizes_do_not_know():
    with pytest.raises(QuantizationError, match="float16"):
        quantize_int4(torch.randn(16, 64), 32, torch.float32)


def test_scales_that_overflow_fp16_are_a_clear_error():
    w = torch.zeros(16, 64)
    w[3, :32] = torch.linspace(-1e6, 1e6, 32)
    with pytest.raises(QuantizationError, match="overflows float16"):
        quantize_int4(w, 32, torch.float16)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_device_without_bf16_quantizes_and_runs_without_ever_touching_bf16(tiny_model_dir, mode):
    # MPS before macOS 14: bf16 raises TypeError there. On the CPU the same path runs in fp16, kernels off, and
    # every dtype any op touches is recorded.
    config = Qwen2Config.from_file(tiny_model_dir / "config.json")
    index = WeightIndex.open(tiny_model_dir)
    reference = OurModel(tiny_model_dir)
    embedded = reference.head.embed(torch.tensor([IDS]))  # [1, L, hidden] fp32

    def quantized(dtype: torch.dtype, half: torch.dtype) -> Stage:
        return Stage.load(config, index, 0, config.num_hidden_layers, dtype, "cpu", pack=False,
                          quantization=Quantization(mode, 32, half, use_kernel=False))

    seen = DtypesSeen()
    with seen:
        stage = quantized(torch.float16, torch.float16)
        pipe = LocalPipeline([stage])
        hidden = pipe.prefill(embedded[:, :-1], capacity=len(IDS))
        step = pipe.decode(embedded[:, -1:], len(IDS) - 1)
    assert torch.bfloat16 not in seen.dtypes, seen.dtypes
    assert torch.float16 in seen.dtypes
    logits = reference.head.logits(torch.cat([hidden, step], dim=1))[0]

    def logits_of(stage: Stage) -> torch.Tensor:
        return reference.head.logits(LocalPipeline([stage]).prefill(embedded, capacity=len(IDS)))[0]

    # against the same quantization computed in fp32: only fp16's rounding of the activations differs
    want = logits_of(quantized(torch.float32, torch.float16))
    assert (logits.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    assert (logits - want).norm() / want.norm() < 0.02
    # and fp16 scales lose nothing against bf16 ones: both as far from the unquantized fp32 model
    exact = reference.full_logits(IDS)
    usual = logits_of(quantized(torch.float32, torch.bfloat16))
    assert (logits - exact).norm() < 1.1 * (usual - exact).norm()


# ------------------------------------------------------------------------------- int8 kernel shape rules


@pytest.mark.parametrize("device_type, shape, ok", [
    ("cpu", (8, 16), True),  # the x86 kernel: K a multiple of 16, any N
    ("cpu", (8, 100), False),
    ("cpu", (896, 4864), True),
    ("mps", (16, 32), False),  # MPS tiles both N and K by 32
    ("mps", (32, 16), False),
    ("mps", (32, 32), True),
    ("mps", (896, 4864), True),
    ("mps", (136, 4864), False),  # 136 = 8 * 17
    ("cuda", (32, 32), True),  # any other device: the strictest rule known, and its probe
    ("cuda", (16, 32), False),
])
def test_int8_kernel_shape_rule_per_device_type(device_type, shape, ok):
    assert int8_kernel_shape_ok(*shape, device_type) is ok


# ----------------------------------------------------------------------- int8 kernel speed on accelerators


@pytest.mark.parametrize("times, choice", [
    ((1.0, 2.0, 5.0, 5.0), (True, False)),  # the kernel wins decode, prefill is a tie: kernel throughout
    ((1.0, 2.0, 5.0, 3.0), (True, True)),  # ... and loses prefill by more than DENSE_PREFILL_MIN_GAIN
    ((1.0, 2.0, 5.0, 4.5), (True, False)),  # ... by less
    ((3.0, 2.0, 1.0, 5.0), (False, False)),  # it loses decode, its whole point: not used
    ((2.0, 2.0, 1.0, 1.0), (True, False)),
])
def test_int8_paths_by_speed(times, choice):
    assert int8_paths_by_speed(*times) == choice


def test_the_device_speed_probe_times_both_paths():
    # it runs wherever the kernel does; on the CPU it checks the timing harness, not which path wins
    use_kernel, dense_prefill = int8_device_speed_probe("cpu", 64, 256, torch.bfloat16)
    assert isinstance(use_kernel, bool) and isinstance(dense_prefill, bool)
    assert not dense_prefill or use_kernel
