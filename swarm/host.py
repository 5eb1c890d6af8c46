"""This machine as a peer sees it: its compute device, the cores it may use and the other peers running on it.

Several peers on one machine (two GPUs, or a quickstart tried on one box) each default to torch's thread count,
one per core, and then fight over the cores: the same swarm trained at ~1.2k tokens/s that way and ~2.6k with
one thread per peer. A peer therefore takes its share of the cores it may run on, counting the
servers and trainers that claimed a state folder on this machine (:func:`swarm.identity.claim_folder`),
itself included, unless ``SWARM_THREADS`` says otherwise, and follows that count as peers come and go
(:class:`ThreadShare`, at each announcement).
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys
from pathlib import Path

import torch

from swarm.identity import STATE_CLAIM


class DeviceUnavailable(ValueError):
    """``SWARM_DEVICE`` names a device this machine does not have (the message names the fix)."""


def resolve_device(name: str) -> torch.device:
    """The compute device of a server: ``auto`` is the first CUDA GPU if torch sees one, else the CPU; ``cpu``,
    ``cuda`` or ``cuda:N`` as named.

    :raises DeviceUnavailable: a CUDA device torch does not see (a CPU build of torch, no driver, or fewer GPUs).
    """
    if name == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        index = device.index or 0
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU build"
            raise DeviceUnavailable(f"SWARM_DEVICE={name}: torch ({build}) sees {torch.cuda.device_count()} CUDA "
                                    "GPUs; install the NVIDIA driver and a CUDA build of torch, or set "
                                    "SWARM_DEVICE=auto")
        return torch.device("cuda", index)
    return device


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, e.g. a container's cpuset), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def peers_on_host() -> int:
    """Servers and trainers running on this machine, this one included once it claimed its state folder: the
    abstract Unix sockets of their claims in ``/proc/net/unix`` (Linux; elsewhere 1)."""
    if not sys.platform.startswith("linux"):
        return 1
    try:
        table = Path("/proc/net/unix").read_text()
    except OSError:
        return 1
    return max(1, table.count(f"@{STATE_CLAIM}"))


def choose_threads(requested: int) -> tuple[int, str]:
    """torch intra-op threads for this peer and why: ``requested`` (``SWARM_THREADS``) if above 0, else its share
    of :func:`usable_cores` among :func:`peers_on_host` (at least 1)."""
    if requested > 0:
        return requested, "SWARM_THREADS"
    cores, peers = usable_cores(), peers_on_host()
    return max(1, cores // peers), f"{cores} cores shared by {peers} peer{'s' if peers > 1 else ''} on this machine"


class ThreadShare:
    """Keeps torch's intra-op threads at :func:`choose_threads` as peers start and stop on this machine: call
    :meth:`update` at start and at each announcement; it logs one line when the count changes."""

    def __init__(self, requested: int):
        self.requested, self.threads = requested, 0

    def update(self, log) -> int:
        threads, why = choose_threads(self.requested)
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.threads = threads
            log.info("torch uses %d thread%s (%s; SWARM_THREADS sets it)", threads, "s" if threads > 1 else "", why)
        return threads


def share_tensors_by_descriptor() -> None:
    """Share tensors between this peer's processes (its averagers, hivemind's futures) by file descriptor.

    hivemind 1.1.12 sets torch's sharing strategy to ``file_system`` when it is imported
    (``hivemind.utils.mpfuture``): each shared tensor is then a named file kept by a ``torch_shm_manager``
    process, and peers' logs ended with ``terminate called after throwing an instance of 'std::system_error'
    what(): No such file or directory`` as they exited (a process freeing its tensors after the manager, or the
    files it removed, had gone). With ``file_descriptor`` there is no manager and the line did not appear; each
    shared tensor holds an open descriptor instead, so the soft limit of open files is raised to the hard one. Call it from entry points before any averager or DHT process
    starts (they inherit the strategy); hivemind imported later reads ``HIVEMIND_MEMORY_SHARING_STRATEGY``."""
    os.environ["HIVEMIND_MEMORY_SHARING_STRATEGY"] = "file_descriptor"  # for processes that import hivemind anew
    torch.multiprocessing.set_sharing_strategy("file_descriptor")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):  # a hard limit above what the kernel allows (RLIM_INFINITY on some systems)
            pass


MMAP_THRESHOLD_BYTES = 32 << 20
"""Allocations from this size up get their own mapping (glibc's ceiling for the setting on 64-bit)."""
TRIM_THRESHOLD_BYTES = 256 << 20
"""Free memory a process keeps for reuse before glibc gives it back to the kernel."""
_MALLOPT = {"MALLOC_TRIM_THRESHOLD_": (-1, TRIM_THRESHOLD_BYTES), "MALLOC_MMAP_THRESHOLD_": (-3, MMAP_THRESHOLD_BYTES)}


def keep_freed_memory() -> bool:
    """Make glibc keep freed tensor memory for reuse instead of handing it back to the kernel at each free.

    glibc serves allocations from 128 kB up (its threshold moves up to 32 MB as it sees them freed) with their own
    ``mmap`` and returns freed memory at the top of the heap beyond twice that; a training step's activations and
    logits (0.8 to 16 MB each at the demo's micro-batch) were then mapped anew at each step, and every page of them
    faulted in zeroed: 4080 minor faults for one (1024 × 4096) float32 logit tensor, 16 MB, ~7 ms of a 50 ms head.
    With the thresholds here, forward + backward of the demo's model (bf16, micro-batches of 8 × 128 tokens, one
    thread) ran at 7024 against 6204 tokens/s and 57k against 357k minor faults (``bench/kernel_ops.
    stage_tokens_per_s``, 2026-11-28). The cost: a process keeps up to :data:`TRIM_THRESHOLD_BYTES` of free memory.

    Sets glibc's ``M_MMAP_THRESHOLD`` and ``M_TRIM_THRESHOLD`` (``mallopt(3)``) in this process, which processes
    forked from it inherit, and the ``MALLOC_*_`` environment variables for processes spawned from it. A variable
    the user set already is left as it is (also in this process). Call it from entry points, early.

    :returns: ``False`` where glibc refused a setting, or is not the C library (musl, macOS: nothing is changed).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    took = True
    for variable, (param, value) in _MALLOPT.items():
        if variable in os.environ:
            continue
        os.environ[variable] = str(value)
        took = mallopt(param, value) == 1 and took
    return took


__all__ = ["DeviceUnavailable", "ThreadShare", "choose_threads", "peers_on_host", "resolve_device",
           "keep_freed_memory", "share_tensors_by_descriptor", "usable_cores"]
