"""How many CPUs (affinity and cgroup quota, not the host's core count) and how much memory (physical
memory, or a cgroup limit below it) this process may really use."""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path


def _cgroup_quota() -> float | None:
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            return int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period_us = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        if quota_us > 0:
            return quota_us / period_us
    except (OSError, ValueError):
        pass
    return None


def available_cpus() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    quota = _cgroup_quota()
    if quota is not None:
        cpus = min(cpus, max(1, math.floor(quota)))
    return max(1, cpus)


def memory_limit() -> int | None:
    """Bytes of memory this process may use: the machine's physical memory, or the cgroup's limit when
    lower; ``None`` when neither can be read."""
    limits = []
    with contextlib.suppress(AttributeError, ValueError, OSError):  # not on every platform
        limits.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            limits.append(int(text))
        break
    limits = [n for n in limits if n > 0]
    return min(limits) if limits else None
