"""A machine's measurement of itself: what a layer costs on its device, per compute dtype and weight mode.

Workers measure themselves before HELLO; the head measures itself for its own share of a token.

Theory of operation: `measure` times a probe, a generic pre-norm decoder layer (norm, fused q/k/v and o
projections, attention over a short cache, a gated MLP with fused gate/up) built from plain torch ops and then
quantized and packed by the same `quantize_linears` and `pack_linears` the real layers go through, so the weight
mode's own kernels run on products of a real layer's kind. It times a decode step at two widths, a small one whose
time is nearly all fixed cost and a large one whose time is nearly all weights (run as a chain of copies holding
STREAM_BYTES in all, so the weights come from memory, not from a cache, as a real stage's do), and fits tc.speed's
cost model through the two: the slope is the weight-streaming rate, the intercept the fixed cost a layer adds. A
prefill of PREFILL_POSITIONS positions through the large probe gives the matrix-multiply rate. Wall-clock medians:
a spike from another process passes, while a machine held to a CPU quota stalls nearly every large step and shows
as it is.

The probe has no family's shapes: its widths are only how many bytes a layer streams, and the planner counts
every real layer in those same bytes (tc.planner.layer_weight_bytes).

`measure_all` measures every (dtype, mode) a worker could be assigned on its device and keeps each result in a
small JSON file under the cache directory, keyed by everything that changes it (device and its name, dtype,
mode, threads, torch version), so a worker pays once per machine and setting (30-60 s for all six on a 2-core
CPU, most of it the bf16 products' own probes). A file of another format version, or unreadable, is measured
again.
"""
from __future__ import annotations

import copy
import json
import logging
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from tc.cache_dir import cache_path
from tc.model import dense, quant
from tc.model.dense import pack_linears
from tc.model.qwen2 import COMPUTE_DTYPES, half_dtype
from tc.speed import Speed, fit_line

log = logging.getLogger(__name__)

BENCH_FORMAT = 2  # bump when the probe changes what a figure means: older cached files are measured again
SMALL = (128, 512)  # (width, MLP width) of the probe whose decode step is nearly all fixed cost
LARGE = (1024, 4096)  # 16.8 M weights: 34 MB in 16 bits, far over a cache, like a real layer
HEAD_DIM = 64
CACHE_POSITIONS = 64  # attention reads a short cache, as most of a short reply's steps do
PREFILL_POSITIONS = 128
STREAM_BYTES = 128 << 20  # several times a CPU's last-level cache: decode reads every weight from memory
DECODE_STEPS = 10
PREFILL_RUNS = 3


@dataclass(frozen=True)
class Measured:
    """One figure: the speed of `device` computing in `dtype` with weights in `quant`."""

    device: str
    dtype: str
    quant: str
    speed: Speed


class _ProbeLayer(nn.Module):
    """A pre-norm decoder layer of `width` with its own KV cache; weights random, values irrelevant."""

    def __init__(self, width: int, mlp_width: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.heads = max(1, width // HEAD_DIM)
        self.head_dim = width // self.heads
        make = lambda fan_out, fan_in: nn.Linear(fan_in, fan_out, bias=False, device=device, dtype=dtype)  # noqa: E731
        self.qkv_proj, self.o_proj = make(3 * width, width), make(width, width)
        self.gate_up_proj, self.down_proj = make(2 * mlp_width, width), make(width, mlp_width)
        self.norm1 = nn.Parameter(torch.ones(width, device=device, dtype=dtype))
        self.norm2 = nn.Parameter(torch.ones(width, device=device, dtype=dtype))
        shape = (1, self.heads, CACHE_POSITIONS + PREFILL_POSITIONS, self.head_dim)  # [B, H, T, D]
        self.k_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.v_cache = torch.zeros(shape, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, position: int) -> torch.Tensor:  # x [1, L, width]
        length = x.shape[1]
        h = F.rms_norm(x, (x.shape[-1],), self.norm1)
        split = lambda t: t.view(1, length, self.heads, self.head_dim).transpose(1, 2)  # noqa: E731  [1, H, L, D]
        q, k, v = (split(t) for t in self.qkv_proj(h).chunk(3, dim=-1))
        self.k_cache[:, :, position:position + length] = k
        self.v_cache[:, :, position:position + length] = v
        keys, values = self.k_cache[:, :, :position + length], self.v_cache[:, :, :position + length]
        attn = F.scaled_dot_product_attention(q, keys, values, is_causal=length > 1 and position == 0)
        x = x + self.o_proj(attn.transpose(1, 2).reshape(1, length, -1))  # [1, L, width]
        h = F.rms_norm(x, (x.shape[-1],), self.norm2)
        gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


def _probe(width: int, mlp_width: int, dtype: torch.dtype, mode: str, group_size: int,
           device: torch.device) -> tuple[_ProbeLayer, int]:
    """A probe layer in weight mode `mode`, and its weight bytes as the planner counts them."""
    layer = _ProbeLayer(width, mlp_width, dtype, device)
    layer.requires_grad_(False)
    quant.quantize_linears(layer, mode, group_size, half_dtype=half_dtype(device))
    pack_linears(layer)  # what stays unquantized takes the fastest product this CPU has, as a real stage's does
    shapes = [(3 * width, width), (width, width), (2 * mlp_width, width), (width, mlp_width)]
    nbytes = sum(quant.quantized_nbytes(shape, mode, group_size) for shape in shapes) + 2 * width * 2
    return layer, nbytes


def _median_s(fn: Callable[[], object], device: torch.device, runs: int) -> float:
    fn()  # warm-up: first calls pick kernels and fault pages in
    quant.synchronize(device)
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        quant.synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _decode_step_s(layers: list[_ProbeLayer], width: int, dtype: torch.dtype, device: torch.device) -> float:
    """Seconds a decode step takes per layer, through `layers` in turn."""
    x = torch.randn(1, 1, width, device=device).to(dtype)
    step = iter(range(10 ** 9))

    def through_all() -> None:
        position = CACHE_POSITIONS - 1 - next(step) % 8
        for layer in layers:
            layer(x, position)

    return _median_s(through_all, device, DECODE_STEPS) / len(layers)


def measure(device: str, dtype_name: str, mode: str, group_size: int = quant.DEFAULT_GROUP_SIZE) -> Speed:
    """Time the probe on `device` computing in `dtype_name` with weights in `mode` (a second or so).

    Raises ValueError for an unknown dtype or mode; whatever the device raises (out of memory) propagates.
    """
    if dtype_name not in COMPUTE_DTYPES:
        raise ValueError(f"unknown compute dtype {dtype_name!r}; use one of {sorted(COMPUTE_DTYPES)}")
    if mode not in quant.WEIGHT_MODES:
        raise ValueError(f"unknown weight mode {mode!r}; use one of {quant.WEIGHT_MODES}")
    dev = torch.device(device)
    dtype = COMPUTE_DTYPES[dtype_name]
    with torch.inference_mode():
        small, small_bytes = _probe(*SMALL, dtype, mode, group_size, dev)
        large, large_bytes = _probe(*LARGE, dtype, mode, group_size, dev)
        copies = max(0, -(-STREAM_BYTES // large_bytes) - 1)
        # a packed (blocked) weight cannot be copied, so an unquantized probe is built again; a quantized one is
        # copied, which skips quantizing it again
        chain = [large] + [_probe(*LARGE, dtype, mode, group_size, dev)[0] if mode == "fp16" else
                           copy.deepcopy(large) for _ in range(copies)]
        small_s = _decode_step_s([small], SMALL[0], dtype, dev)
        large_s = _decode_step_s(chain, LARGE[0], dtype, dev)
        del chain[1:]
        prompt = torch.randn(1, PREFILL_POSITIONS, LARGE[0], device=dev).to(dtype)
        prefill_s = _median_s(lambda: large(prompt, 0), dev, PREFILL_RUNS)
    overhead_s, seconds_per_byte = fit_line((small_bytes, small_s), (large_bytes, large_s))
    weights_prefill_s = max(prefill_s - overhead_s, 1e-9)
    return Speed(decode_bytes_per_s=1 / seconds_per_byte,
                 prefill_bytes_per_s=large_bytes * PREFILL_POSITIONS / weights_prefill_s,
                 layer_overhead_s=overhead_s)


def cache_key(device: str, device_name: str, dtype: str, mode: str, threads: int) -> str:
    """A file name for one figure: everything that changes it, made safe for any file system, including whether
    the mode's products run natively (a figure measured on PyTorch's kernels is not one for tc's own)."""
    raw = f"{device}-{device_name}-{dtype}-{mode}-t{threads}-torch{torch.__version__}{_native_tag(device, dtype, mode)}"
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in raw) + ".json"


def _native_tag(device: str, dtype: str, mode: str) -> str:
    """"-native" where the measured layer takes tc's native products (int4/int8 layers, or bf16 ones that
    dense.fastest_product may give the native product): a figure measured without them means another speed."""
    if dtype not in COMPUTE_DTYPES or torch.device(device).type != "cpu":
        return ""
    if mode == "fp16":
        native = COMPUTE_DTYPES[dtype] == torch.bfloat16 and dense.native_bf16_available()
    else:
        native = quant.native_by_default(mode, "cpu", COMPUTE_DTYPES[dtype])
    return "-native" if native else ""


def _read_cached(path: Path) -> Speed | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("ignoring the bench cache file %s (%s); measuring again", path, exc)
        return None
    if not isinstance(data, dict) or data.get("format") != BENCH_FORMAT:
        return None  # another probe's figure: it may mean something else
    try:
        return Speed(float(data["decode_bytes_per_s"]), float(data["prefill_bytes_per_s"]),
                     float(data["layer_overhead_s"]))
    except (KeyError, TypeError, ValueError) as exc:
        log.warning("ignoring the bench cache file %s (%s); measuring again", path, exc)
        return None


def _write_cached(path: Path, speed: Speed) -> None:
    data = {"format": BENCH_FORMAT, "decode_bytes_per_s": speed.decode_bytes_per_s,
            "prefill_bytes_per_s": speed.prefill_bytes_per_s, "layer_overhead_s": speed.layer_overhead_s,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data), encoding="utf-8")
        tmp.replace(path)  # whole or not at all: another worker on this machine may be reading it
    except OSError as exc:  # a read-only home costs a re-measure next time, nothing more
        log.warning("could not keep the bench result in %s (%s); it will be measured again next start", path, exc)


def default_bench_dir(environ: Mapping[str, str] = os.environ) -> Path | None:
    """Where figures are kept between starts unless told otherwise: `bench/` of tc's cache (tc/cache_dir.py); None
    (measured at every start) where there is none."""
    return cache_path("bench", environ=environ)


def measure_all(device: str, device_name: str, dtypes: tuple[str, ...], cache_dir: Path | None,
                fresh: bool = False, modes: tuple[str, ...] = quant.WEIGHT_MODES) -> tuple[Measured, ...]:
    """Every (dtype, mode) figure for `device`, from the cache where it has one (unless `fresh`), else measured.

    `cache_dir` None measures without reading or writing any file.
    """
    threads = torch.get_num_threads()
    paths = {(dtype, mode): None if cache_dir is None else
             Path(cache_dir) / cache_key(device, device_name, dtype, mode, threads)
             for dtype in dtypes for mode in modes}
    speeds = {key: None if path is None or fresh else _read_cached(path) for key, path in paths.items()}
    missing = [f"{dtype} {mode}" for (dtype, mode), speed in speeds.items() if speed is None]
    if missing:  # up to a minute of probe lines before anything else: say what they are for, once
        log.info("measuring this machine's %s for the head's planner (%s; %d threads; %s)", device,
                 ", ".join(missing), threads, "measured at every start" if cache_dir is None else
                 f"kept in {cache_dir} for later starts")
    figures = []
    for (dtype, mode), path in paths.items():
        speed = speeds[dtype, mode]
        if speed is None:
            started = time.perf_counter()
            speed = measure(device, dtype, mode)
            log.info("bench %s %s %s: decode %.2f GB/s, prefill %.1f GB/s, %.3f ms a layer (%.1fs)", device,
                     dtype, mode, speed.decode_bytes_per_s / 1e9, speed.prefill_bytes_per_s / 1e9,
                     speed.layer_overhead_s * 1e3, time.perf_counter() - started)
            if path is not None:
                _write_cached(path, speed)
        figures.append(Measured(device, dtype, mode, speed))
    return tuple(figures)


def bench_table(figures: tuple[Measured, ...], threads: int) -> str:
    """What `worker --bench` prints: one row a figure, then the `speed:` line to copy into the topology."""
    lines = [f"{'device':<8} {'dtype':<5} {'quant':<5} {'decode GB/s':>11} {'prefill GB/s':>12} {'layer ms':>9}"]
    for f in figures:
        t = f.speed.as_topology()
        lines.append(f"{f.device:<8} {f.dtype:<5} {f.quant:<5} {t['decode_gbps']:>11g} {t['prefill_gbps']:>12g} "
                     f"{t['layer_ms']:>9g}")
    lines.append("")
    lines.append(f"measured with {threads} torch thread(s). In topology.yaml, under the node this machine runs "
                 "(for the topology's quant and the node's dtype):")
    for f in figures:
        t = f.speed.as_topology()
        lines.append(f"  # {f.dtype} {f.quant}:  speed: {{decode_gbps: {t['decode_gbps']:g}, "
                     f"prefill_gbps: {t['prefill_gbps']:g}, layer_ms: {t['layer_ms']:g}}}")
    return "\n".join(lines)
