"""What this machine can compute on: CUDA GPUs, Apple MPS, and the CPU."""
from __future__ import annotations

import logging
import os
import platform
import sys
from pathlib import Path
from typing import Callable

import torch

from ..model.qwen2 import device_supports_bf16, mps_supports_bf16
from ..protocol.messages import DeviceInfo
from ..topology import parse_device


log = logging.getLogger(__name__)


class DeviceError(ValueError):
    """The requested device is not on this machine."""


def _cpu_memory(say: bool = False) -> tuple[int | None, int | None]:
    """(total, available) memory in bytes for this process: the machine's, within its memory cgroup's limit where
    one is set (a container's --memory: the machine's figures would offer the head memory the kernel kills the
    worker for using). `say`: log the limit where it binds."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.strip()}
        total, available = info.get("MemTotal"), info.get("MemAvailable")
    except OSError:  # not Linux: total from sysconf where it exists, available unknown
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), None
        except (ValueError, OSError, AttributeError):
            return None, None
    limited = cgroup_memory()
    if limited is None:
        return total, available
    limit, left = limited
    if say and (total is None or limit < total):
        log.info("this process's memory cgroup allows %.1f GiB (a container's or service's limit), %.1f GiB of it "
                 "free: those are the figures this worker offers", limit / 2**30, left / 2**30)
    return (limit if total is None else min(total, limit)), (left if available is None else min(available, left))


CGROUP_ROOT = Path("/sys/fs/cgroup")
NO_LIMIT = 1 << 62  # cgroup v1 writes "no limit" as 2**63 - 1 rounded down to a page


def cgroup_memory(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = CGROUP_ROOT
                  ) -> tuple[int, int] | None:
    """(limit, available) of the memory cgroup this process runs in, where a limit is set (a container's
    --memory, a systemd unit's MemoryMax): the tightest from its cgroup up, and that limit less what that cgroup
    uses, its page cache left out (the kernel drops it for the worker's memory, as MemAvailable counts it: a model
    read before in the same container would otherwise count as used). v2's memory.max, or v1's
    memory.limit_in_bytes; None without a limit, or where cgroups cannot be read."""
    try:
        lines = proc_cgroup.read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "" and (root / "cgroup.controllers").is_file():  # v2, mounted whole at the root
            found = _tightest(root, path, "memory.max", "memory.current", ("active_file", "inactive_file"))
        elif "memory" in controllers.split(","):  # v1's memory controller
            found = _tightest(root / "memory", path, "memory.limit_in_bytes", "memory.usage_in_bytes",
                              ("total_active_file", "total_inactive_file"))
        else:
            continue
        if found is not None:
            return found
    return None


def _tightest(mount: Path, path: str, limit_file: str, usage_file: str, cache: tuple[str, ...]
              ) -> tuple[int, int] | None:
    directory = mount / path.strip("/")
    if not directory.is_dir():  # a cgroup namespace (a container's) shows its own cgroup as "/": the mount
        directory = mount
    tightest: tuple[int, Path] | None = None
    while True:
        limit = _read_number(directory / limit_file)
        if limit is not None and limit < NO_LIMIT and (tightest is None or limit < tightest[0]):
            tightest = (limit, directory)
        if directory == mount or mount not in directory.parents:
            break
        directory = directory.parent
    if tightest is None:
        return None
    limit, directory = tightest
    used = _read_number(directory / usage_file) or 0
    droppable = 0
    try:
        for line in (directory / "memory.stat").read_text(encoding="ascii").splitlines():
            key, _, value = line.partition(" ")
            if key in cache and value.strip().isdigit():
                droppable += int(value)
    except OSError:
        pass
    return limit, max(0, limit - max(0, used - droppable))


def _read_number(path: Path) -> int | None:
    """A cgroup file's one number; None where it is absent, unreadable or "max" (no limit)."""
    try:
        text = path.read_text(encoding="ascii").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


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
    total, available = _cpu_memory(say=selected is not None)  # the figures offered: said once, not per lookup
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
