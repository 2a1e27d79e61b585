"""llama.cpp files for a target and its EAGLE-3 head, and a running ``llama-server`` over them.

llama.cpp (``scripts/setup_llamacpp.sh`` builds release b11434 into ``.tools/llama.cpp``) reads GGUF files written by
its own converter (``convert_hf_to_gguf.py``, run here with the kit's interpreter): the target from its Hugging Face
checkpoint, an EAGLE-3 head from the official layout with ``--target-model-dir`` (it takes the tokenizer, the target's
width and the tapped layers from there). Two things the converter needs that a kit head may leave out are written
into a temporary copy of the head first: the token embedding (a head saved with ``embedding_from_target``; llama.cpp's
EAGLE-3 graph embeds with the head's own ``token_embd``) and ``eagle_aux_hidden_state_layer_ids`` at the top level of
config.json (the converter reads it there; the kit also writes it inside ``eagle_config`` for vLLM). llama.cpp taps
the hidden states *entering* the listed layers, as the kit does.

    python -m specdec_kit.export.llamacpp --target smollm2 --draft zoo/smollm2/eagle3 --out engines/smollm2-llamacpp

writes ``target-f32.gguf`` and ``eagle3-f32.gguf`` there and prints the ``llama-server`` command that serves them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUTTYPES = ("f32", "f16", "bf16", "q8_0")


class LlamaCppError(RuntimeError):
    """llama.cpp is missing, or one of its tools failed; the message says which and how to set it up."""


def tools_dir() -> Path:
    """Where ``scripts/setup_llamacpp.sh`` put llama.cpp (``SPECDEC_LLAMACPP_DIR`` overrides)."""
    return Path(os.environ.get("SPECDEC_LLAMACPP_DIR", REPO / ".tools" / "llama.cpp"))


def tool(name: str) -> Path:
    path = tools_dir() / "bin" / name
    if not path.is_file():
        raise LlamaCppError(f"{path}: missing; build llama.cpp with: bash scripts/setup_llamacpp.sh")
    return path


def converter() -> Path:
    path = tools_dir() / "src" / "convert_hf_to_gguf.py"
    if not path.is_file():
        raise LlamaCppError(f"{path}: missing; build llama.cpp with: bash scripts/setup_llamacpp.sh")
    return path


def convert(source: Path, out: Path, outtype: str = "f32", target_dir: Path | None = None) -> Path:
    """llama.cpp's converter over a Hugging Face checkpoint (``target_dir``: the target of a draft head)."""
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype {outtype!r}: expected one of {list(OUTTYPES)}")
    command = [sys.executable, str(converter()), str(source), "--outtype", outtype, "--outfile", str(out)]
    if target_dir is not None:
        command += ["--target-model-dir", str(target_dir)]
    out.parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0 or not out.is_file():
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-12:])
        raise LlamaCppError(f"convert_hf_to_gguf.py {source} failed (exit {done.returncode}):\n{tail}")
    return out


def eagle3_for_llamacpp(head: Path, target_dir: Path, out: Path) -> Path:
    """A copy of an EAGLE-3 head as llama.cpp's converter reads it: with the token embedding (the target's, where the
    head takes it from there) and the tapped layers at the top level of config.json."""
    from specdec_kit.runtime.checkpoint import save_draft
    from specdec_kit.runtime.loader import load_draft_for
    from specdec_kit.runtime.models.target import TargetModel

    target = TargetModel.from_pretrained(str(target_dir))
    draft = load_draft_for(target, "eagle3", head)
    save_draft(draft.float(), out, "eagle3", safetensors=True)
    config = json.loads((out / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = list(draft.feature_layers)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def export_head(target_dir: Path, head: Path, out: Path, outtype: str = "f32") -> Path:
    """An EAGLE-3 head's GGUF (``out/eagle3-<outtype>.gguf``) for the target in ``target_dir``."""
    with tempfile.TemporaryDirectory(prefix="eagle3-") as tmp:
        copy = eagle3_for_llamacpp(head, target_dir, Path(tmp) / "eagle3")
        return convert(copy, out / f"eagle3-{outtype}.gguf", outtype, target_dir=target_dir)


def export(target_dir: Path, head: Path | None, out: Path, outtype: str = "f32") -> dict[str, Path]:
    """The target's GGUF and (with ``head``) its EAGLE-3 head's, in ``out``."""
    files = {"target": convert(target_dir, out / f"target-{outtype}.gguf", outtype)}
    if head is not None:
        files["draft"] = export_head(target_dir, head, out, outtype)
    return files


def server_command(
    target: Path,
    draft: Path | None,
    port: int,
    threads: int | None = None,
    draft_tokens: int = 3,
    slots: int = 1,
    context: int = 4096,
) -> list[str]:
    """``llama-server`` over ``target`` with ``slots`` parallel sequences sharing ``context`` tokens of KV cache,
    speculating with an EAGLE-3 ``draft`` when given, on ``threads`` compute threads (None: llama.cpp's own choice,
    the machine's physical cores)."""
    command = [str(tool("llama-server")), "-m", str(target), "--port", str(port)]
    if threads is not None:
        command += ["-t", str(threads)]
    command += ["-c", str(context), "-np", str(slots), "--no-webui"]
    if draft is not None:
        command += ["-md", str(draft), "--spec-type", "draft-eagle3", "--spec-draft-n-max", str(draft_tokens)]
    return command


@dataclass
class LlamaServer:
    """A ``llama-server`` process, started and waited for; ``complete`` asks it for a greedy completion."""

    command: list[str]
    port: int
    log: Path
    process: subprocess.Popen | None = field(default=None, repr=False)

    def __enter__(self) -> "LlamaServer":
        self.process = subprocess.Popen(self.command, stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise LlamaCppError(f"llama-server exited ({self.process.returncode}); its log: {self.log}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        self.__exit__()
        raise LlamaCppError(f"llama-server did not answer /health within 300 s; its log: {self.log}")

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()

    def complete(self, prompt: list[int], max_tokens: int) -> dict:
        """Greedy completion of token ids -> llama.cpp's answer (``tokens``, and ``timings`` with the drafted and
        accepted counts)."""
        body = {
            "prompt": prompt,
            "n_predict": max_tokens,
            "temperature": 0.0,
            "cache_prompt": False,
            "return_tokens": True,
            "ignore_eos": True,
        }
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/completion",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=600) as r:
            return json.loads(r.read())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m specdec_kit.export.llamacpp",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", required=True, help="the target: a Hugging Face checkpoint directory, or smollm2")
    p.add_argument("--draft", type=Path, help="an EAGLE-3 head (official layout) to convert beside it")
    p.add_argument("--out", type=Path, required=True, help="directory for the GGUF files")
    p.add_argument("--outtype", default="f32", choices=OUTTYPES, help="the files' precision (default f32)")
    args = p.parse_args(argv)
    from specdec_kit.runtime.models.pretrained import resolve_target

    try:
        files = export(resolve_target(args.target), args.draft, args.out, args.outtype)
    except (LlamaCppError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    command = server_command(files["target"], files.get("draft"), 8080)
    print(" ".join(command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
