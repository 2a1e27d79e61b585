"""The memory bandwidth this process gets now, measured. On a shared machine it moves with the other tenants' traffic,
and plain decoding's speed moves with it (a step of a small model reads every weight once), while a speculative
cycle's verification of several tokens moved less: on SmolLM2 over 2 cores with ONNX Runtime's MatMul, plain
decoding's median was 68 tokens/s in the samples where a copy ran at 40-50 GB/s and 82 where it ran at 70-80,
GRIFFIN's 104 and 101 (``specdec-bench-bandwidth``). A CPU benchmark's speedups are read against it."""

from __future__ import annotations

import statistics
import time

import torch


def copy_bandwidth_gbs(megabytes: int = 256, repeats: int = 3) -> float:
    """GB/s read and written copying a buffer of ``megabytes`` MB (far beyond any cache) with torch's threads, the
    threads the runtime's graphs use: the median of ``repeats`` copies after an untimed one (which pays the pages'
    first touch)."""
    if megabytes < 1 or repeats < 1:
        raise ValueError(f"copy bandwidth: expected megabytes >= 1 and repeats >= 1, got {megabytes} and {repeats}")
    source = torch.ones(megabytes * 2**20 // 4)
    target = torch.empty_like(source)
    target.copy_(source)
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        target.copy_(source)
        seconds.append(time.perf_counter() - started)
    return 2 * source.numel() * 4 / statistics.median(seconds) / 1e9
