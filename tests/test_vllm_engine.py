"""The vLLM tier: the zoo's EAGLE-2, HASS, GRIFFIN, EAGLE-3, P-EAGLE and DFlash heads exported with ``--backend vllm``
and RUN in vLLM's server (vLLM's CPU build, in .venv-vllm from scripts/setup_vllm.sh, which the README's test command
runs); EAGLE-3 and P-EAGLE in vLLM's own ``Eagle3LlamaForCausalLM`` (P-EAGLE from the speculators format), DFlash in
its ``DFlashQwen3ForCausalLM`` (also a head over a reduced vocabulary, from the speculators format), the others in the
kit's plugin classes.

For each head: greedy output through vLLM's OpenAI server equals ``transformers`` greedy decoding of the target;
the draft's logits at every proposal step of a recorded prompt equal the kit's own draft logits within 1e-4 (so a
dropped or misread weight cannot pass; for EAGLE-3 over the same draft vocabulary, -inf elsewhere in both); vLLM's acceptance length is within 3% of the kit's for the same proposal
(a top-1 chain of the same length) on the same prompts. A tampered head is refused by the plugin's strict loader.
The n-gram export runs vLLM's own prompt lookup: the same greedy output and acceptance as the kit's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from conftest import chi_square_pvalue, hf_greedy
from server_helpers import free_port

from specdec_kit.bench.servers import SERVED_NAME, start_vllm
from specdec_kit.paths import default_zoo
from specdec_kit.runtime.core.trees import parse_tree_spec
from specdec_kit.runtime.decoding.generate import SpeculativeGenerator
from specdec_kit.runtime.loader import load_draft_for, make_drafter
from specdec_kit.runtime.models.target import TargetModel
from specdec_kit.runtime.registry import drafter_for

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[1]
CHAIN = 3  # vLLM's num_speculative_tokens; the kit drafts the same top-1 chain (static:chain-3)
NEW_TOKENS = 64
PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    "class Config:\n    def __init__(self",
    "for i in range(10):\n",
    "    return self.",
    "def test_",
    "# Copyright",
    "if __name__ == '__main__':\n",
]
ZOO_HEAD = {
    "eagle2": "eagle",
    "hass": "hass",
    "griffin": "griffin",
    "eagle3": "eagle3",
    "peagle": "peagle",
    "dflash": "dflash",
}
# the chain each kind drafts: a parallel draft grows dynamic trees only (a top-1 chain of CHAIN tokens)
CHAIN_TREE = {kind: f"dynamic:{CHAIN + 1}:{CHAIN - 1}:1" for kind in ("peagle", "dflash")}
# kinds served from the speculators format (--draft-format speculators: vLLM converts the config and reads speculators'
# weight names); the others from the official layout
SPECULATORS_FORMAT = ("peagle", "dflash-vocab")
STARTUP_S = 900
# vLLM's engine core and its worker in one process (on the CPU, vLLM allows its in-process executor only without V1
# multiprocessing): a start without a worker process to spawn and import, 15-20 s less on 2 cores. The plugin, its
# mends and its loader run in that process as they do in the worker; the benchmark and the chart's PP check start vLLM
# as users do.
ONE_PROCESS_ARGS = ["--distributed-executor-backend", "uni"]
ONE_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


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


def build(kind: str, out: Path, tree: str = f"static:chain-{CHAIN}", extra: tuple[str, ...] = ()) -> Path:
    """The user's command: python export/build_engine.py --draft KIND --backend vllm."""
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "export" / "build_engine.py"),
            "--draft",
            kind,
            "--backend",
            "vllm",
            "--tree",
            tree,
            "--output",
            str(out),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"num_speculative_tokens={CHAIN}" in proc.stdout + proc.stderr  # the build says how the tree maps
    return out


class VllmServer:
    """``specdec-serve --engine`` on a vLLM engine: the kit's launcher execs vLLM's own OpenAI server. With a
    ``compile_cache`` directory, as users and the chart run it (vLLM's default compiled path, engine core and worker
    processes, that directory as vLLM's cache); without, eager in one process, which starts minutes sooner."""

    def __init__(self, engine: Path, python: str, trace: Path | None, log: Path, compile_cache: Path | None = None):
        quick = ([], {}) if compile_cache else (["--enforce-eager", *ONE_PROCESS_ARGS], ONE_PROCESS_ENV)
        cache = {"VLLM_CACHE_ROOT": str(compile_cache)} if compile_cache else {}
        self.server = start_vllm(
            "vllm",
            engine,
            python,
            speculative=True,
            max_model_len=1024,
            kv_cache_gib=None,  # specdec-serve sizes vLLM-CPU's KV cache from the engine: the users' path
            log=log,
            extra=quick[0],
            extra_env={**quick[1], **cache, **({"SPECDEC_VLLM_DRAFT_TRACE": str(trace)} if trace else {})},
        )
        self.url, self.log = self.server.url, log
        self.server.wait_ready("/health", STARTUP_S)
        started = log.read_text()
        assert "vLLM-CPU KV cache: 0." in started and "16 sequences of 1024 tokens" in started
        assert "Exception ignored" not in started, started[-3000:]  # e.g. a oneDNN handle released while tracing

    def complete(self, prompt: list[int]) -> list[int]:
        body = {
            "model": SERVED_NAME,
            "prompt": prompt,
            "max_tokens": NEW_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        resp = httpx.post(self.url + "/v1/completions", json=body, timeout=600)
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["token_ids"]

    def acceptance(self) -> float:
        return self.server.acceptance_length({})

    def stop(self) -> None:
        self.server.stop()


class RecordingStep:
    """The kit's draft step, recording (position, input token, logits) of every row it scores."""

    def __init__(self, inner):
        self.inner, self.rows = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, *args, logits_at=None):
        block = len(args) == 4  # a DFlash block step: (tokens, positions, mask, cache) -> logits
        out = self.inner(*args, logits_at=logits_at)
        tokens, positions = args[:2] if block else args[1:3]
        logits = out if block else out[0]
        at = logits_at if logits_at is not None else torch.arange(tokens.shape[1])[None].expand_as(tokens)
        for pos, tok, row in zip(positions.gather(1, at)[0], tokens.gather(1, at)[0], logits[0]):
            self.rows.append((int(pos), int(tok), row.float().clone()))
        return out


def kit_run(kind: str, target: TargetModel, prompts: list[list[int]], head: Path | None = None):
    """The kit's own speculative decoding with the same head (default: the zoo's) and the same top-1 chain ->
    (tokens per prompt, acceptance length over all prompts, the first prompt's recorded draft rows)."""
    module = load_draft_for(target, kind, head or default_zoo() / ZOO_HEAD[kind])
    drafter = drafter_for(kind, module, target, parse_tree_spec(CHAIN_TREE.get(kind, f"static:chain-{CHAIN}")))
    recorder = drafter.step = RecordingStep(drafter.step)
    generator = SpeculativeGenerator(target, drafter, eos_token_ids=[])
    admit = generator.admit

    def admit_unrecorded(running, new):  # the draft reads a prompt as it joins; that reading proposes nothing
        before = len(recorder.rows)
        batch = admit(running, new)
        del recorder.rows[before:]
        return batch

    generator.admit = admit_unrecorded
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
        rows += [
            (int(p), int(t), logit) for p, t, logit in zip(record["positions"], record["tokens"], record["logits"])
        ]
    return rows


def logit_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max |a - b| over the finite entries, which must be the same ones (EAGLE-3: its draft vocabulary)."""
    finite = torch.isfinite(a)
    if not torch.equal(finite, torch.isfinite(b)):
        return float("inf")
    return float((a[finite] - b[finite]).abs().max())


def reduced_vocabulary_dflash(target: TargetModel, folder: Path) -> Path:
    """The zoo's DFlash head over three quarters of the vocabulary, with an LM head of its own (``d2t``/``t2d``,
    ``draft_vocab_size``: how speculators trains DFlash heads), saved in the official layout."""
    from specdec_kit.runtime.checkpoint import save_draft
    from specdec_kit.runtime.synthetic import dflash_with_draft_vocab

    full = load_draft_for(target, "dflash", default_zoo() / ZOO_HEAD["dflash"])
    save_draft(dflash_with_draft_vocab(full, target, 3 * target.vocab_size // 4), folder, "dflash", safetensors=True)
    return folder


@pytest.mark.parametrize("case", ["griffin", "eagle2", "hass", "eagle3", "peagle", "dflash", "dflash-vocab"])
def test_the_head_runs_in_vllm_exactly_as_in_the_kit(case, vllm_python, zoo_target, prompts, references, tmp_path):
    """P-EAGLE: vLLM's EAGLE-3 class with parallel drafting, the whole chain from one forward, its draft written in
    the speculators format (vLLM reads the config and speculators' weight names itself). DFlash: vLLM's
    ``DFlashQwen3ForCausalLM``, a block of the root and CHAIN masked slots; ``dflash-vocab``: a head over a reduced
    vocabulary in the speculators format, scored by its own LM head and mapped to target ids by ``d2t`` in vLLM as
    in the kit. GRIFFIN runs on the path users serve (compiled, worker processes, a fresh compile cache); the others
    eagerly in one process."""
    kind = case.split("-")[0]
    head = reduced_vocabulary_dflash(zoo_target, tmp_path / "head") if case == "dflash-vocab" else None
    layout = ("--draft-format", "speculators") if case in SPECULATORS_FORMAT else ()
    extra = (*layout, *(("--target", str(default_zoo() / "target"), "--draft-path", str(head)) if head else ()))
    engine = build(kind, tmp_path / f"{kind}-vllm", CHAIN_TREE.get(kind, f"static:chain-{CHAIN}"), extra)
    assert ("speculators_model_type" in (engine / "vllm" / "draft" / "config.json").read_text()) == bool(layout)
    kit_tokens, kit_tau, kit_rows = kit_run(kind, zoo_target, prompts, head)
    assert kit_tokens == references  # the kit itself is lossless on these prompts
    trace = tmp_path / "trace"
    compile_cache = tmp_path / "vllm-cache" if kind == "griffin" else None
    server = VllmServer(engine, vllm_python, trace, tmp_path / "vllm.log", compile_cache)
    try:
        for file in trace.glob("*.pt"):  # drop what start-up runs recorded
            file.unlink()
        first = server.complete(prompts[0])
        rows = vllm_rows(trace)
        served = [first] + [server.complete(p) for p in prompts[1:]]
        tau = server.acceptance()
    finally:
        server.stop()
    assert served == references, f"{case}: vLLM's greedy output differs from transformers'"
    # the draft's logits at every proposal step of the recorded prompt
    # vLLM proposes once more after the last token (the request is finished before that proposal is verified)
    assert len(kit_rows) > NEW_TOKENS // (CHAIN + 1) and 0 <= len(rows) - len(kit_rows) <= CHAIN
    rows = rows[: len(kit_rows)]
    assert [(p, t) for p, t, _ in rows] == [(p, t) for p, t, _ in kit_rows]
    worst = max(logit_difference(a, b) for (_, _, a), (_, _, b) in zip(rows, kit_rows))
    assert worst < 1e-4, f"{case}: draft logits differ from the kit's by {worst:.2e}"
    assert abs(tau - kit_tau) <= 0.03 * kit_tau, (
        f"{case}: acceptance length {tau:.3f} in vLLM vs {kit_tau:.3f} in the kit"
    )
    print(f"{case}: acceptance length vLLM {tau:.3f}, kit {kit_tau:.3f}; max |draft logit diff| {worst:.1e}")


def test_prompt_lookup_runs_in_vllm_with_the_kits_greedy_output(vllm_python, zoo_target, prompts, references, tmp_path):
    """The n-gram export (no draft weights: vLLM's own ngram proposer) served by vLLM-CPU: greedy output identical to
    the kit's prompt lookup and to transformers', and the same acceptance length (within 3%) over the steps that
    drafted, as vLLM counts them."""
    settings = tmp_path / "ngram.json"  # vLLM continues an n-gram's oldest occurrence: the kit does the same here
    settings.write_text(  # and verifies whole chains, as vLLM does
        '{"prompt_lookup_min": 1, "prompt_lookup_max": 4, "occurrences": 1, "use_oldest": true, "size_by_cost": false}'
    )
    chain = f"dynamic:{CHAIN + 1}:{CHAIN - 1}:1"  # a chain of CHAIN tokens
    engine = build("ngram", tmp_path / "ngram-vllm", chain, ("--lookup-settings", str(settings)))
    drafter = make_drafter(zoo_target, "ngram", settings, parse_tree_spec(chain))
    proposed = []  # vLLM counts only the steps that drafted (a step without a match proposes nothing)
    propose = drafter.proposals

    def counted(tokens, counts):
        roots, found = propose(tokens, counts)
        proposed.extend(len(f) > 0 for f in found)
        return roots, found

    drafter.proposals = counted
    generator = SpeculativeGenerator(zoo_target, drafter, eos_token_ids=[])
    kit = [generator.generate([p], NEW_TOKENS)[0] for p in prompts]
    kit_tau = 1 + sum(r.stats.accepted_tokens for r in kit) / sum(proposed)
    assert [r.tokens for r in kit] == references
    server = VllmServer(engine, vllm_python, None, tmp_path / "vllm.log")
    try:
        served = [server.complete(p) for p in prompts]
        tau = server.acceptance()
    finally:
        server.stop()
    assert served == references, "vLLM's n-gram speculation changed the greedy output"
    assert kit_tau > 1.05, f"the kit's prompt lookup accepted nothing (tau {kit_tau:.3f})"
    assert abs(tau - kit_tau) <= 0.03 * kit_tau, f"acceptance length vLLM {tau:.3f}, kit {kit_tau:.3f}"
    print(f"ngram: acceptance length vLLM {tau:.3f}, kit {kit_tau:.3f}")


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
        ["bash", str(engine / "vllm" / "serve.sh"), "--max-model-len", "1024", "--enforce-eager", *ONE_PROCESS_ARGS],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        timeout=STARTUP_S,
        env=dict(
            os.environ,
            SPECDEC_VLLM_PYTHON=vllm_python,
            VLLM_CPU_KVCACHE_SPACE="1",
            PORT=str(free_port()),
            **ONE_PROCESS_ENV,
        ),
    )
    out = log.read_text()
    assert proc.returncode != 0
    assert "does not match the architecture" in out and "layers.0.self_attn.o_proj.bias" in out, out[-3000:]


SAMPLED = {"temperature": 1.5, "top_k": 4}  # a support small enough to enumerate, wide enough to reject drafts
SAMPLED_PROMPT = "    return self."
SAMPLES, PER_REQUEST = 2000, 500  # n per request; vLLM seeds the n children seed, seed + 1, ...


@torch.no_grad()
def exact_first_three(target: TargetModel, prompt: list[int]) -> tuple[dict, dict]:
    """p(x1, x2) and p(x3) of the processed target distribution, by enumerating its (top-k) support."""
    from specdec_kit.runtime.core.sampling import SamplingParams, target_probs

    params = SamplingParams(**SAMPLED)

    def probs(prefixes: list[list[int]]) -> torch.Tensor:
        return target_probs(target.hf_model(torch.tensor(prefixes)).logits[:, -1], params).double()

    p1 = probs([prompt])[0]
    firsts = p1.nonzero().flatten().tolist()
    joint = {
        (a, b): p1[a] * row[b]
        for a, row in zip(firsts, probs([prompt + [a] for a in firsts]))
        for b in row.nonzero().flatten().tolist()
    }
    third: dict[int, torch.Tensor] = {}
    for (a, b), row in zip(joint, probs([prompt + [a, b] for a, b in joint])):
        for c in row.nonzero().flatten().tolist():
            third[c] = third.get(c, 0.0) + joint[a, b] * row[c]
    return joint, third


def goodness_of_fit(samples: list, exact: dict) -> float:
    """Chi-square p-value of the samples against ``exact``; a sample outside its support is an impossible draw."""
    keys = list(exact) + ["outside the target's support"]
    observed = torch.zeros(len(keys))
    for s in samples:
        observed[keys.index(s) if s in exact else -1] += 1
    return chi_square_pvalue(observed, torch.tensor([float(exact[k]) for k in exact] + [0.0], dtype=torch.float64))


def test_sampling_through_vllm_draws_from_the_target_distribution(vllm_python, zoo_target, tmp_path):
    """vLLM's rejection sampler over the plugin's GRIFFIN drafts (temperature and top-k, with the plugin's mends of
    vLLM's CPU sampling): the first token comes from the prefill, the second and third from verifying a 3-token
    draft; their distributions are the target's (chi-square, false alarm below 1e-3 per check), and the drafts
    were really verified (acceptance above 1, below the chain)."""
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(default_zoo() / "tokenizer")(SAMPLED_PROMPT)["input_ids"]
    joint, third = exact_first_three(zoo_target, prompt)
    server = VllmServer(build("griffin", tmp_path / "griffin-vllm"), vllm_python, None, tmp_path / "vllm.log")
    try:
        drawn = []
        for seed in range(0, SAMPLES, PER_REQUEST):
            body = {
                "model": SERVED_NAME,
                "prompt": prompt,
                "max_tokens": 3,
                "ignore_eos": True,
                "n": PER_REQUEST,
                "seed": seed,
                "return_token_ids": True,
                **SAMPLED,
            }
            resp = httpx.post(server.url + "/v1/completions", json=body, timeout=600)
            assert resp.status_code == 200, resp.text
            drawn += [c["token_ids"] for c in resp.json()["choices"]]
        tau = server.acceptance()
    finally:
        server.stop()
    assert "mended vLLM's CPU sampling" in server.log.read_text()
    assert len(drawn) == SAMPLES and all(len(t) == 3 for t in drawn)
    assert 1.05 < tau < CHAIN + 1, f"acceptance length {tau:.3f}: the drafts were not verified as expected"
    p_pair = goodness_of_fit([tuple(t[:2]) for t in drawn], joint)
    p_third = goodness_of_fit([t[2] for t in drawn], third)
    print(f"vLLM sampling: acceptance length {tau:.3f}, p(x1, x2) {p_pair:.3g}, p(x3) {p_third:.3g}")
    assert p_pair > 1e-3 and p_third > 1e-3


def test_vllm_cpu_build_has_the_sampling_defects_the_plugin_mends(vllm_python):
    """Without the mends, this vLLM's CPU build leaves expanded temperatures unwritten and fails top-k on a step
    without drafts (both lossy or fatal for sampled speculative decoding); the plugin finds and mends both. When a
    newer vLLM fixes them, this fails: the mends are then no-ops to remove."""
    code = (
        "from specdec_vllm import cpu_sampling_fixes as f\n"
        "from vllm.utils import cpu_triton_utils as c\n"
        "applied = f.install()\n"
        "print(applied, f.expand_is_broken(c._expand_kernel_impl))\n"
    )
    assert last_line_in_vllm(vllm_python, code) == "['expand_kernel', 'top_k_on_no_draft_rows'] False"


def test_vllm_cpu_build_releases_onednn_handles_outside_tracing_once_mended(vllm_python):
    """This vLLM's CPU build fails to release a oneDNN matmul handle collected while a fake-tensor mode is active
    (as under ``torch.compile``'s tracing, where it ended a worker); the plugin's mend releases it there. When a newer
    vLLM fixes it, this fails: the mend is then a no-op to remove."""
    code = (
        "from specdec_vllm import onednn_handles as m\n"
        "from vllm import _custom_ops as ops\n"
        "applied = m.install()\n"
        "print(applied, m.release_fails_while_tracing(ops))\n"
    )
    assert last_line_in_vllm(vllm_python, code) == "['onednn_handle_release'] False"


def last_line_in_vllm(vllm_python: str, code: str) -> str:
    """What ``code`` prints last, run by vLLM's interpreter with the plugin importable."""
    proc = subprocess.run(
        [vllm_python, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=str(REPO / "export" / "plugins" / "vllm")),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]
