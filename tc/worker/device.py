"""What this machine can compute on: CUDA GPUs, Apple MPS, and the CPU."""
from __future__ import annotations

import os
import platform
import sys
from typing import Callable

import torch

from ..model.qwen2 import device_supports_bf16, mps_supports_bf16
from ..protocol.messages import DeviceInfo
from ..topology import parse_device


class DeviceError(ValueError):
    """The requested device is not on this machine."""


def _cpu_memory() -> tuple[int | None, int | None]:
    """(total, available) system memory in bytes."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.strip()}
        return info.get("MemTotal"), info.get("MemAvailable")
    except OSError:  # not Linux: total from sysconf where it exists, available unknown
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), None
        except (ValueError, OSError, AttributeError):
            return None, None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def cuda_devices(count: int, describe: Callable[[int], tuple[str, int]], free_memory: Callable[[int], int],
                 selected: str | None) -> list[DeviceInfo]:
    """DeviceInfo for CUDA devices 0..count-1 from `describe(i)` -> (name, total bytes), with free memory from
    `free_memory(i)` for the `selected` device id alone (None: for none).

    Asking a device for its free memory (cudaMemGetInfo) creates a CUDA context on it, a few hundred MB of GPU
    memory held until the process ends, on GPUs this worker will never compute on and that others may be using.
    """
    devices = []
    for i in range(count):
        name, total = describe(i)
        device_id = f"cuda:{i}"
        free = int(free_memory(i)) if device_id == selected else None
        devices.append(DeviceInfo(id=device_id, type="cuda", name=name, total_memory=int(total), free_memory=free))
    return devices


def _cuda_describe(i: int) -> tuple[str, int]:
    props = torch.cuda.get_device_properties(i)  # no context: the runtime reads these without one
    return props.name, props.total_memory


def detect_devices(selected: str | None = None) -> list[DeviceInfo]:
    """Every device torch can use here, best first: CUDA GPUs, then MPS, then the CPU.

    A CUDA GPU's free memory is asked of the `selected` device id only (see cuda_devices); the others say None.
    """
    devices: list[DeviceInfo] = []
    if torch.cuda.is_available():
        devices += cuda_devices(torch.cuda.device_count(), _cuda_describe,
                                lambda i: torch.cuda.mem_get_info(i)[0], selected)
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        # MPS reports no device memory; recommended_max_memory is the closest figure where torch has it
        recommended = getattr(torch.mps, "recommended_max_memory", None)
        total = int(recommended()) if recommended else None
        devices.append(DeviceInfo(id="mps", type="mps", name="Apple Silicon MPS", total_memory=total,
                                  free_memory=None))
    total, available = _cpu_memory()
    devices.append(DeviceInfo(id="cpu", type="cpu", name=_cpu_name(), total_memory=total, free_memory=available))
    return devices


def select_device(requested: str, devices: list[DeviceInfo]) -> str:
    """The device id to use for `requested` (auto, cpu, cuda, cuda:N, mps). Raises DeviceError."""
    ids = [d.id for d in devices]
    try:
        kind, _ = parse_device(requested)  # what is no device at all says so, as the topology's device does
    except ValueError as exc:
        raise DeviceError(str(exc)) from None
    if requested == "auto":
        return ids[0]
    if requested == "cuda":
        requested = "cuda:0"
    if requested in ids:
        return requested
    missing = f"device {requested!r} is not available on this machine (it has: {', '.join(ids)})"
    if kind == "cuda" and torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        # a GPU box given PyTorch's CPU-only build; pip keeps it for "torch==X" (X+cpu satisfies it)
        raise DeviceError(f"{missing}: this PyTorch ({torch.__version__}) is built without CUDA; pip uninstall "
                          "torch, then install a CUDA build (from PyPI on Linux x86-64, or PyTorch's index for your "
                          "CUDA version)")
    raise DeviceError(missing)


def offered_devices(requested: str, selected: str, devices: list[DeviceInfo]) -> list[DeviceInfo]:
    """The devices a worker offers the head, which fills a topology entry that one of them can serve: every one for
    --device auto, else the one `requested` named (`selected`): a worker started with --device cuda:1 took an
    entry of the machine's CPU, or of cuda:0, where one came first in the topology."""
    if requested == "auto":
        return devices
    return [d for d in devices if d.id == selected]


def compute_dtypes(device: str) -> tuple[str, ...]:
    """Compute dtypes the device runs natively (see resolve_compute_dtype for the fallbacks of the others)."""
    kind = torch.device(device).type
    if kind == "cpu":
        return ("bf16", "fp32")
    if kind == "mps":
        return ("fp16", "fp32", "bf16") if mps_supports_bf16() else ("fp16", "fp32")
    if kind == "cuda":
        return ("fp16", "bf16", "fp32") if device_supports_bf16(device) else ("fp16", "fp32")
    return ("fp32",)


def system_summary() -> dict[str, str]:
    return {"hostname": platform.node(), "platform": sys.platform, "python_version": platform.python_version(),
            "torch_version": str(torch.__version__)}
