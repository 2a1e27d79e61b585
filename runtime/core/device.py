"""Device choice and timing that work the same on CPU and CUDA (CUDA is used when present)."""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch

from specdec_kit.runtime.core.manifest import DTYPE_NAMES


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(device: str | torch.device | None) -> torch.device:
    return default_device() if device in (None, "auto") else torch.device(device)


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels so wall-clock timings mean something; a no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def now(device: torch.device) -> float:
    synchronize(device)
    return time.perf_counter()


DTYPES = {name: getattr(torch, canonical) for name, canonical in DTYPE_NAMES.items()}


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """Default: float32 on CPU (half precision is slow there), bfloat16 on CUDA."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    return DTYPES[dtype]


@contextlib.contextmanager
def torch_threads(count: int | None) -> Iterator[None]:
    """torch's intra-op thread count set to ``count`` inside the block and restored after (None: left alone)."""
    before = torch.get_num_threads()
    if count is None or count == before:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
