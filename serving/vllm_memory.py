"""vLLM-CPU's KV cache sized from what the engine needs, not from a share of the machine.

vLLM's CPU build reserves ``--gpu-memory-utilization`` (0.92 by default) of the whole machine's memory and refuses to
start when less than that is free: on a host that also runs other work, a 135M-parameter engine failed with 14 of
23.5 GiB free. What a server needs is its sequences' keys and values: every layer's (the target's and the draft's)
for ``--max-num-seqs`` sequences of ``--max-model-len`` tokens. ``specdec-serve`` passes that as
``--kv-cache-memory-bytes`` (which vLLM then takes instead of the share), shrunk to what is free beside the weights
when memory is short, with a note saying how many full-length sequences fit.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

GIB = 1 << 30
HEADROOM = 2 * GIB  # vLLM's own process beside the weights and the cache: the interpreter, torch, its buffers
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
OVERRIDES = ("--kv-cache-memory-bytes", "--gpu-memory-utilization")  # the user's own sizing wins


class KvCacheError(ValueError):
    """Not even one sequence of the context fits beside the weights."""


@dataclass
class KvCachePlan:
    bytes: int
    sequences: int  # full-length sequences it holds
    note: str


def is_cpu_build(python: str) -> bool:
    """Whether ``python``'s vLLM is the CPU build (the ``vllm-cpu`` distribution, or a source build tagged ``+cpu``),
    asked without importing vLLM."""
    probe = (
        "import importlib.metadata as m, sys\n"
        "for name in ('vllm-cpu', 'vllm'):\n"
        "    try:\n"
        "        v = m.version(name)\n"
        "    except m.PackageNotFoundError:\n"
        "        continue\n"
        "    sys.exit(0 if name == 'vllm-cpu' or '+cpu' in v else 1)\n"
        "sys.exit(1)\n"
    )
    try:
        return subprocess.run([python, "-c", probe], cwd="/", capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def available_memory() -> int:
    """Bytes the kernel can give without swapping (``MemAvailable``), else the free pages."""
    import os

    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def bytes_per_token(manifest: dict) -> int:
    """Keys and values of one token in every layer vLLM caches: the target's and a draft head's."""
    size = DTYPE_BYTES.get(manifest["dtype"], 4)
    parts = [manifest["target"], *([manifest["draft"]] if "num_hidden_layers" in manifest["draft"] else [])]
    return sum(2 * p["num_hidden_layers"] * p["num_key_value_heads"] * p["head_dim"] * size for p in parts)


def weights_bytes(engine: Path) -> int:
    """What vLLM loads: the engine's target and draft files (links to a shared target followed)."""
    folders = [engine / "target", engine / "vllm" / "draft"]
    return sum(f.stat().st_size for d in folders if d.exists() for f in d.rglob("*") if f.is_file())


def plan_kv_cache(per_token: int, context: int, sequences: int, available: int, weights: int) -> KvCachePlan:
    """The cache for ``sequences`` of ``context`` tokens, or as many as fit in ``available`` beside ``weights``."""
    need = per_token * context * sequences
    room = available - weights - HEADROOM
    one = per_token * context
    if room < one:
        raise KvCacheError(
            f"vLLM-CPU: {available / GIB:.1f} GiB of memory is free; the engine's weights take {weights / GIB:.1f} "
            f"GiB and vLLM about {HEADROOM / GIB:.0f} more, and one sequence of {context} tokens needs "
            f"{one / GIB:.2f} GiB of KV cache: pass a smaller --max-model-len or free memory"
        )
    if need <= room:
        return KvCachePlan(
            need, sequences, f"vLLM-CPU KV cache: {need / GIB:.2f} GiB for {sequences} sequences of {context} tokens"
        )
    fits = room // one
    return KvCachePlan(
        fits * one,
        int(fits),
        f"vLLM-CPU KV cache: {fits * one / GIB:.2f} GiB, room for {fits} of {sequences} sequences at the full "
        f"{context} tokens (all would need {need / GIB:.2f} GiB; {available / GIB:.1f} GiB free, weights "
        f"{weights / GIB:.1f} GiB); shorter ones share it, vLLM queues what does not fit: pass a smaller "
        "--max-model-len or free memory for more",
    )


def option_value(args: list[str], name: str) -> str | None:
    """The value of ``name`` among a server's arguments (``--name value`` or ``--name=value``), else None."""
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def kv_cache_flags(
    engine: Path, manifest: dict, max_model_len: int | None, max_num_seqs: int, server_args: list[str], environ
) -> tuple[list[str], str | None]:
    """vLLM's options for a cache sized from the engine (and a note saying what it got), or none where the user
    sized it (``VLLM_CPU_KVCACHE_SPACE``, or the options themselves after ``--``). The context and the sequences are
    the user's vLLM options where given there, else ``specdec-serve``'s."""
    if environ.get("VLLM_CPU_KVCACHE_SPACE") or any(option_value(server_args, o) for o in OVERRIDES):
        return [], None
    context = int(option_value(server_args, "--max-model-len") or max_model_len or manifest["target"]["max_context"])
    given = option_value(server_args, "--max-num-seqs")
    sequences = int(given or max_num_seqs)
    plan = plan_kv_cache(bytes_per_token(manifest), context, sequences, available_memory(), weights_bytes(engine))
    return [
        "--kv-cache-memory-bytes",
        str(plan.bytes),
        *([] if given else ["--max-num-seqs", str(sequences)]),
    ], plan.note
