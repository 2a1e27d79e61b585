"""The kit's ONNX Runtime CPU operators, compiled once per machine from their C source and cached.

The library holds ``specdec.PackedMatMul`` (``packed_matmul.c``): ONNX Runtime's float MatMul on a small x86 CPU
costs 1.2-1.6x for the handful of rows a speculative cycle verifies what it costs for one row, where a product that
reads each weight once for all rows costs barely more, so speculation pays more. ``specdec.TreeAttention``
(``tree_attention.c``): ONNX's Attention with a boolean mask and grouped-query heads, which ONNX Runtime's CPU kernel
runs about three times slower than reading the cache costs at long contexts on an Intel Xeon. And
``specdec.Int8MatMul`` (``int8_matmul.c``): a draft's 8-bit ``MatMulNBits`` on AVX-512 VNNI, which ONNX Runtime's
kernel took about half of a draft tree's call for. ``register_ops.c`` registers them. It is built with the machine's
C compiler for the machine's own instruction set (``-march=native``); the cache key holds the sources, the compiler
and the CPU, so another machine sharing the cache builds its own. Where no compiler is found, or
``SPECDEC_PACKED_MATMUL=0`` is set, ``custom_op_library`` says why and the engines run ONNX Runtime's own operators.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from specdec_kit.runtime.models.pretrained import cache_root

SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in ("ort_api.h", "packed_matmul.c", "tree_attention.c", "int8_matmul.c", "register_ops.c")
)
SWITCH_ENV = "SPECDEC_PACKED_MATMUL"  # "0": ONNX Runtime's own MatMul and Attention everywhere (no library)
ATTENTION_SWITCH_ENV = "SPECDEC_TREE_ATTENTION"  # "0": ONNX Runtime's own Attention, the kit's MatMul kept
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-shared", "-fPIC")
LIBRARIES = ("-lm",)


@dataclass(frozen=True)
class CustomOps:
    """The compiled library, or why there is none."""

    library: Path | None
    reason: str = ""


def enabled() -> bool:
    return os.environ.get(SWITCH_ENV, "1") != "0"


def tree_attention_enabled() -> bool:
    """Whether graphs rewritten for the library run their attention as ``TreeAttention`` too."""
    return os.environ.get(ATTENTION_SWITCH_ENV, "1") != "0"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_identity() -> str:
    """What ``-march=native`` compiles for: the CPU's model and flags where Linux tells them."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))


@functools.cache
def custom_op_library() -> CustomOps:
    """The library's path, compiled on first use (a second or two) and kept under ``$SPECDEC_CACHE/kernels``."""
    if not enabled():
        return CustomOps(None, f"{SWITCH_ENV}=0")
    compiler = _compiler()
    if compiler is None:
        return CustomOps(None, "no C compiler (cc, gcc or clang) on PATH")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    key = hashlib.sha256(
        "\0".join([*(source.read_text() for source in SOURCES), compiler, *version, *FLAGS, _cpu_identity()]).encode()
    ).hexdigest()[:16]
    library = cache_root() / "kernels" / key / "libspecdec_ort_ops.so"
    if library.exists():
        return CustomOps(library)
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:  # processes building at once each rename theirs
        built = Path(scratch) / library.name
        compiled = [str(source) for source in SOURCES if source.suffix == ".c"]
        result = subprocess.run(
            [compiler, *FLAGS, *compiled, "-o", str(built), *LIBRARIES], capture_output=True, text=True
        )
        if result.returncode != 0:
            return CustomOps(None, f"{compiler} could not build the kit's operators: {result.stderr.strip()[-400:]}")
        os.replace(built, library)
    return CustomOps(library)


@functools.cache
def int8_matmul_vectorized() -> bool:
    """Whether the library's ``Int8MatMul`` runs on AVX-512 VNNI here (compiled for this CPU); without it the operator
    computes the same in scalar C, slower than ONNX Runtime's ``MatMulNBits``, so graphs keep that."""
    import ctypes

    library = custom_op_library().library
    return library is not None and bool(ctypes.CDLL(str(library)).specdec_int8_matmul_vectorized())


def forget_library() -> None:
    """Forget the library found and what it was built with, so the next call looks again (after a switch or a cache
    directory changed)."""
    custom_op_library.cache_clear()
    int8_matmul_vectorized.cache_clear()


@contextlib.contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    before = os.environ.get(name)
    os.environ[name] = value
    forget_library()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
        forget_library()


@contextlib.contextmanager
def packed_matmul_switched(on: bool, tree_attention: bool = True) -> Iterator[None]:
    """Sessions opened inside run the kit's operators (``on``, where they build: ``PackedMatMul``, and
    ``TreeAttention`` unless ``tree_attention`` is off) or ONNX Runtime's own: what a benchmark that sets them side
    by side opens its engines under."""
    with (
        _environment(SWITCH_ENV, "1" if on else "0"),
        _environment(ATTENTION_SWITCH_ENV, "1" if tree_attention else "0"),
    ):
        yield
