"""What the CPU is, read without torch (light modules' benchmarks and the trainers' precision choice ask it)."""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path


@functools.cache
def cpuinfo_lines() -> tuple[str, ...]:
    """Linux's /proc/cpuinfo, line by line (empty elsewhere); read once."""
    try:
        return tuple(Path("/proc/cpuinfo").read_text().splitlines())
    except OSError:
        return ()


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags."""
    return frozenset(word for line in cpuinfo_lines() if line.startswith("flags") for word in line.split()[2:])


def cpu_description() -> str:
    """The CPU's model name and its widest vector instructions, which a CPU benchmark's speedups depend on: a tree's
    verification and draft cost a different number of plain steps on an AVX2 machine than on an AVX-512 one."""
    names = [line.split(":", 1)[1].strip() for line in cpuinfo_lines() if line.startswith("model name")]
    name = names[0] if names else platform.processor() or platform.machine()
    flags = cpu_flags()
    widest = next(
        (isa for isa, flag in (("AMX", "amx_tile"), ("AVX-512", "avx512f"), ("AVX2", "avx2")) if flag in flags), None
    )
    return f"{name} ({widest})" if widest else name


def process_threads() -> int:
    """The compute threads one process should run: ``OMP_NUM_THREADS`` where set (processes sharing the cores set it,
    as the kit's own runtime honours it), else every core this process may use. A server given more threads than it
    has cores stalls in its own barriers: ``llama-server -t 2`` beside one busy process decodes 50x slower."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if value.isdigit() and int(value) > 0:
        return int(value)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
