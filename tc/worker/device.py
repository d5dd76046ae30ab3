"""What this machine can compute on: CUDA GPUs, Apple MPS, and the CPU."""
from __future__ import annotations

import os
import platform
import sys

import torch

from ..model.qwen2 import mps_supports_bf16
from ..protocol.messages import DeviceInfo


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


def detect_devices() -> list[DeviceInfo]:
    """Every device torch can use here, best first: CUDA GPUs, then MPS, then the CPU."""
    devices: list[DeviceInfo] = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            free, total = torch.cuda.mem_get_info(i)
            devices.append(DeviceInfo(id=f"cuda:{i}", type="cuda", name=props.name, total_memory=int(total),
                                      free_memory=int(free)))
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
    if requested == "auto":
        return ids[0]
    if requested == "cuda":
        requested = "cuda:0"
    if requested in ids:
        return requested
    raise DeviceError(f"device {requested!r} is not available on this machine (it has: {', '.join(ids)})")


def compute_dtypes(device: str) -> tuple[str, ...]:
    """Compute dtypes the device runs natively (see resolve_compute_dtype for the fallbacks of the others)."""
    kind = torch.device(device).type
    if kind == "cpu":
        return ("bf16", "fp32")
    if kind == "mps":
        return ("fp16", "fp32", "bf16") if mps_supports_bf16() else ("fp16", "fp32")
    if kind == "cuda":
        with torch.cuda.device(torch.device(device)):
            return ("fp16", "bf16", "fp32") if torch.cuda.is_bf16_supported() else ("fp16", "fp32")
    return ("fp32",)


def system_summary() -> dict[str, str]:
    return {"hostname": platform.node(), "platform": sys.platform, "python_version": platform.python_version(),
            "torch_version": str(torch.__version__)}
