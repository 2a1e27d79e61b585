"""The vLLM tier: the zoo's EAGLE-2, HASS and GRIFFIN heads exported with ``--backend vllm`` and RUN in vLLM's
server (vLLM's CPU build, in .venv-vllm from scripts/setup_vllm.sh, which the README's test command runs).

For each head: greedy output through vLLM's OpenAI server equals ``transformers`` greedy decoding of the target;
the draft's logits at every proposal step of a recorded prompt equal the kit's own draft logits within 1e-4 (so a
dropped or misread weight cannot pass); vLLM's acceptance length is within 3% of the kit's for the same proposal
(a top-1 chain of the same length) on the same prompts. A tampered head is refused by the plugin's strict loader.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from specdec_kit.paths import default_zoo
from specdec_kit.runtime.drafts.loading import load_draft
from specdec_kit.runtime.generate import SpeculativeGenerator
from specdec_kit.runtime.registry import drafter_for
from specdec_kit.runtime.target import TargetModel
from specdec_kit.runtime.trees import parse_tree_spec

from conftest import hf_greedy
from server_helpers import free_port, wait_until_ready

REPO = Path(__file__).resolve().parents[1]
CHAIN = 3  # vLLM's num_speculative_tokens; the kit drafts the same top-1 chain (static:chain-3)
NEW_TOKENS = 64
PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main():\n", "class Config:\n    def __init__(self",
           "for i in range(10):\n", "    return self.", "def test_", "# Copyright", "if __name__ == '__main__':\n"]
ZOO_HEAD = {"eagle2": "eagle", "hass": "hass", "griffin": "griffin"}
STARTUP_S = 900


@pytest.fixture(scope="module")
def vllm_python() -> str:
    python = os.environ.get("SPECDEC_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")
    if not Path(python).exists():
        pytest.fail(f"vLLM's interpreter not found at {python}: run `bash scripts/setup_vllm.sh` "
                    "(scripts/test.sh does it before the tests)")
    return python


@pytest.fixture(scope="module")
def zoo_target():
    return TargetModel.from_pretrained(default_zoo() / "target", dtype=torch.float32)


@pytest.fixture(scope="module")
def prompts(zoo_target) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_zoo() / "tokenizer")
    return [tokenizer(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def references(zoo_target, prompts) -> list[list[int]]:
    return [hf_greedy(zoo_target.hf_model, p, NEW_TOKENS) for p in prompts]


def build(kind: str, out: Path) -> Path:
    """The user's command: python export/build_engine.py --draft KIND --backend vllm."""
    proc = subprocess.run([sys.executable, str(REPO / "export" / "build_engine.py"), "--draft", kind, "--backend",
                           "vllm", "--tree", f"static:chain-{CHAIN}", "--output", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"num_speculative_tokens={CHAIN}" in proc.stdout + proc.stderr  # the build says how the tree maps
    return out


class VllmServer:
    """``specdec-serve --engine`` on a vLLM engine: the kit's launcher execs vLLM's own OpenAI server."""

    def __init__(self, engine: Path, python: str, trace: Path, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, SPECDEC_VLLM_PYTHON=python, VLLM_CPU_KVCACHE_SPACE="1",
                   SPECDEC_VLLM_DRAFT_TRACE=str(trace), VLLM_LOGGING_LEVEL="INFO")
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specdec_kit.serving", "--engine", str(engine), "--port", str(self.port),
             "--served-model-name", "demo", "--max-model-len", "1024", "--", "--enforce-eager"],
            stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            wait_until_ready(self.url + "/health", STARTUP_S, lambda: self.proc.poll() is not None and
                             f"vLLM exited ({self.proc.returncode}):\n{self.tail()}", interval=2)
        except RuntimeError:
            self.stop()
            raise

    def tail(self) -> str:
        return self.log.read_text()[-4000:]

    def complete(self, prompt: list[int]) -> list[int]:
        body = {"model": "demo", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True,
                "return_token_ids": True}
        resp = httpx.post(self.url + "/v1/completions", json=body, timeout=600)
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["token_ids"]

    def acceptance(self) -> float:
        counters = {}
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total"):
                if line.startswith(name + "{") or line.startswith(name + " "):
                    counters[name] = counters.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return 1 + counters["vllm:spec_decode_num_accepted_tokens_total"] / counters["vllm:spec_decode_num_drafts_total"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class RecordingStep:
    """The kit's draft step, recording (position, input token, logits) of every row it scores."""

    def __init__(self, inner):
        self.inner, self.rows = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, features, tokens, positions, pending_mask, cache, logits_at=None):
        logits, reg = self.inner(features, tokens, positions, pending_mask, cache, logits_at)
        at = logits_at if logits_at is not None else torch.arange(tokens.shape[1])[None].expand_as(tokens)
        for pos, tok, row in zip(positions.gather(1, at)[0], tokens.gather(1, at)[0], logits[0]):
            self.rows.append((int(pos), int(tok), row.float().clone()))
        return logits, reg


def kit_run(kind: str, target: TargetModel, prompts: list[list[int]]):
    """The kit's own speculative decoding with the same head and the same top-1 chain -> (tokens per prompt,
    acceptance length over all prompts, the first prompt's recorded draft rows)."""
    module = load_draft(default_zoo() / ZOO_HEAD[kind], kind, target.hidden_size, target.vocab_size)
    drafter = drafter_for(kind, module, target, parse_tree_spec(f"static:chain-{CHAIN}"))
    recorder = drafter.step = RecordingStep(drafter.step)
    generator = SpeculativeGenerator(target, drafter, eos_token_ids=[])
    outputs, first_rows = [], None
    accepted = cycles = 0
    for i, prompt in enumerate(prompts):
        recorder.rows = []
        result = generator.generate([prompt], NEW_TOKENS)[0]
        if i == 0:
            first_rows = recorder.rows
        outputs.append(result.tokens[:NEW_TOKENS])
        accepted += result.stats.accepted_tokens
        cycles += result.stats.spec_cycles
    return outputs, 1 + accepted / cycles, first_rows


def vllm_rows(trace: Path) -> list[tuple[int, int, torch.Tensor]]:
    rows = []
    for file in sorted(trace.glob("*.pt"), key=lambda p: int(p.stem.split("-")[1])):
        record = torch.load(file)
        rows += [(int(p), int(t), l) for p, t, l in zip(record["positions"], record["tokens"], record["logits"])]
    return rows


@pytest.mark.parametrize("kind", ["griffin", "eagle2", "hass"])
def test_the_head_runs_in_vllm_exactly_as_in_the_kit(kind, vllm_python, zoo_target, prompts, references, tmp_path):
    engine = build(kind, tmp_path / f"{kind}-vllm")
    kit_tokens, kit_tau, kit_rows = kit_run(kind, zoo_target, prompts)
    assert kit_tokens == references  # the kit itself is lossless on these prompts
    trace = tmp_path / "trace"
    server = VllmServer(engine, vllm_python, trace, tmp_path / "vllm.log")
    try:
        for file in trace.glob("*.pt"):  # drop what start-up runs recorded
            file.unlink()
        first = server.complete(prompts[0])
        rows = vllm_rows(trace)
        served = [first] + [server.complete(p) for p in prompts[1:]]
        tau = server.acceptance()
    finally:
        server.stop()
    assert served == references, f"{kind}: vLLM's greedy output differs from transformers'"
    # the draft's logits at every proposal step of the recorded prompt
    # vLLM proposes once more after the last token (the request is finished before that proposal is verified)
    assert len(kit_rows) > NEW_TOKENS // (CHAIN + 1) and 0 <= len(rows) - len(kit_rows) <= CHAIN
    rows = rows[:len(kit_rows)]
    assert [(p, t) for p, t, _ in rows] == [(p, t) for p, t, _ in kit_rows]
    worst = max(float((a - b).abs().max()) for (_, _, a), (_, _, b) in zip(rows, kit_rows))
    assert worst < 1e-4, f"{kind}: draft logits differ from the kit's by {worst:.2e}"
    assert abs(tau - kit_tau) <= 0.03 * kit_tau, f"{kind}: acceptance length {tau:.3f} in vLLM vs {kit_tau:.3f} in the kit"
    print(f"{kind}: acceptance length vLLM {tau:.3f}, kit {kit_tau:.3f}; max |draft logit diff| {worst:.1e}")


def test_vllm_refuses_a_draft_tensor_the_plugin_has_no_place_for(vllm_python, tmp_path):
    """vLLM's own EAGLE loader drops unknown tensors (``fc.bias``) without a word; the plugin's loader refuses
    them, so a head that does not match its architecture never serves."""
    from safetensors.torch import load_file, save_file

    engine = build("eagle2", tmp_path / "eagle2-vllm")
    weights = engine / "vllm" / "draft" / "model.safetensors"
    state = load_file(str(weights))
    state["layers.0.self_attn.o_proj.bias"] = torch.zeros(state["fc.bias"].shape)
    save_file(state, str(weights))
    log = tmp_path / "vllm.log"
    # straight to vLLM through the engine's serve.sh (the kit's launcher would refuse the changed file first)
    proc = subprocess.run(
        ["bash", str(engine / "vllm" / "serve.sh"), "--max-model-len", "1024", "--enforce-eager"],
        stdout=log.open("w"), stderr=subprocess.STDOUT, timeout=STARTUP_S,
        env=dict(os.environ, SPECDEC_VLLM_PYTHON=vllm_python, VLLM_CPU_KVCACHE_SPACE="1", PORT=str(free_port())))
    out = log.read_text()
    assert proc.returncode != 0
    assert "does not match the architecture" in out and "layers.0.self_attn.o_proj.bias" in out, out[-3000:]
