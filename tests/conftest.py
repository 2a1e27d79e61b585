"""Shared tiny models and reference generations (all built in memory, CPU, seconds)."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch
from schedule import longest_first
from scipy import stats
from tiers import TIERS, missing_tool

from specdec_kit.runtime.models.target import TargetModel
from specdec_kit.runtime.synthetic import tiny_hf_model

# A test that asks for one of these fixtures is in that tier, whatever its module says.
TIER_OF_FIXTURE = {"vllm_python": "vllm", "interchange_python": "interchange", "chart": "helm"}


def pytest_configure(config):
    for marker, needs in TIERS.items():
        config.addinivalue_line("markers", f"{marker}: {needs}")
    import specdec_kit.runtime

    checkout = Path(__file__).resolve().parents[1]
    if Path(specdec_kit.runtime.__file__).resolve().parent != checkout / "runtime":
        raise pytest.UsageError(
            f"this interpreter's kit is {Path(specdec_kit.runtime.__file__).parent.parent}, not "
            f"this checkout ({checkout}): a shared set-up follows the checkout that ran it last; run "
            "`bash scripts/setup.sh` here"
        )


def pytest_collection_modifyitems(items):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the collection the processes share out, module by module
        items[:] = longest_first(items)
    for item in items:
        for fixture, tier in TIER_OF_FIXTURE.items():
            if fixture in item.fixturenames and tier not in {m.name for m in item.iter_markers()}:
                item.add_marker(getattr(pytest.mark, tier))


NUM_PROMPTS = 20
NEW_TOKENS = 64


def make_prompts(vocab: int, count: int = NUM_PROMPTS, seed: int = 1234, lo: int = 3, hi: int = 24) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (count,), generator=gen).tolist()
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def hf_greedy(hf_model, prompt: list[int], new_tokens: int) -> list[int]:
    """The target's own greedy decoding through ``transformers`` ``generate``."""
    ids = torch.tensor([prompt])
    out = hf_model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


class TargetCase:
    """A target plus its prompts and its transformers-greedy references (computed once)."""

    def __init__(self, name: str, **kwargs):
        self.name = name
        self.hf = tiny_hf_model(**kwargs)
        self.target = TargetModel(self.hf)
        self.prompts = make_prompts(self.target.vocab_size)

    @functools.cached_property
    def references(self) -> list[list[int]]:
        return [hf_greedy(self.hf, p, NEW_TOKENS) for p in self.prompts]


@pytest.fixture(scope="session")
def random_case() -> TargetCase:
    """A plain random Llama with GQA: drafts rarely agree with it."""
    return TargetCase(
        "random", hidden_size=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=256, logit_scale=8.0, seed=11
    )


@pytest.fixture(scope="session")
def predictable_case() -> TargetCase:
    """Mostly-bigram Llama: the oracle drafts of ``synthetic`` predict it well (high acceptance)."""
    return TargetCase(
        "predictable",
        hidden_size=96,
        layers=2,
        heads=4,
        kv_heads=2,
        intermediate=192,
        vocab=80,
        context_mix=0.3,
        logit_scale=20.0,
        seed=7,
    )


SMALL_DEMO = dict(hidden_size=64, layers=2, heads=4, kv_heads=2, intermediate=128)


@pytest.fixture(scope="session")
def demo_checkpoints(tmp_path_factory):
    """A small target (with tokenizer) and one draft per kind in their official layouts on disk."""
    from specdec_kit.runtime.demo import write_demo

    return write_demo(tmp_path_factory.mktemp("checkpoints"), shape=SMALL_DEMO)


@pytest.fixture(scope="session")
def eagle3_checkpoint(demo_checkpoints, tmp_path_factory) -> Path:
    """An EAGLE-3 head for the small demo target, trained by the kit's trainer (training-time test, a draft
    vocabulary of three quarters of the target's) and written in the official layout: no oracle exists for EAGLE-3,
    and engines are only worth checking with drafts that get accepted."""
    from specdec_kit.runtime.models.target import TargetModel
    from specdec_kit.train.eagle3 import Eagle3Spec, train_eagle3

    target = TargetModel.from_pretrained(demo_checkpoints["target"], dtype="float32", device="cpu")
    data = torch.randint(0, target.vocab_size, (64, 64), generator=torch.Generator().manual_seed(0))
    spec = Eagle3Spec(
        steps=100,
        batch=8,
        seq_len=64,
        lr=3e-3,
        warmup=10,
        draft_vocab=3 * target.vocab_size // 4,
        ttt_length=4,
        feature_layers=list(range(target.num_layers)),
    )
    out = tmp_path_factory.mktemp("eagle3") / "head"
    train_eagle3(target, data, spec, out, base_model=str(demo_checkpoints["target"]), progress=False)
    return out


@pytest.fixture(scope="session")
def demo_engine(demo_checkpoints, tmp_path_factory):
    """An ONNX Runtime GRIFFIN engine of the small demo checkpoints (for the server and load tests), drafting level by
    level (``draft_tree=False``: the one-call graph's export takes a minute; the ONNX export tests check it)."""
    from specdec_kit.export.builder import build_engine

    inputs = griffin_inputs(demo_checkpoints, draft_tree=False)
    return build_engine(inputs, tmp_path_factory.mktemp("served") / "engine").path


def griffin_inputs(paths: dict, tree=None, **options):
    """Builder inputs of the demo checkpoints' GRIFFIN head: an ONNX Runtime float32 engine with a 12-node dynamic
    tree unless ``tree`` or ``options`` (``BuildInputs`` fields) say otherwise."""
    from specdec_kit.export.inputs import BuildInputs
    from specdec_kit.runtime.core.trees import DynamicTreeConfig, tree_to_dict

    return BuildInputs(
        **{
            "draft": "griffin",
            "target": paths["target"],
            "draft_path": paths["griffin"],
            "tokenizer": paths["target"],
            "backend": "onnxruntime",
            "dtype": "float32",
            "tree": tree_to_dict(tree or DynamicTreeConfig(12, 3, 3)),
            **options,
        }
    )


@pytest.fixture(scope="session")
def zoo_engines(tmp_path_factory) -> Path:
    """One directory of the demo zoo's engines for the whole run, as ``--engines`` of the benchmarks: an engine one
    test builds there (``<kind>-<backend>``) the next one reuses (the builder matches its inputs). Building the zoo's
    20-layer target into ONNX takes minutes on 2 cores. Under pytest-xdist the test processes share it (the builder
    locks an engine's directory while it builds, so a second process waits for the first and reuses its engine)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = tmp_path_factory.getbasetemp().parent / "zoo-engines"
        shared.mkdir(exist_ok=True)
        return shared
    return tmp_path_factory.mktemp("zoo-engines")


@pytest.fixture(scope="session")
def chart():
    """The Helm chart driven by the real Helm CLI (the chart, engine-rule, SGLang and vLLM tests render it)."""
    from helm_cli import HelmChart

    return HelmChart()


def left_in(directory: Path) -> list[str]:
    """What a build left in ``directory``, less the builder's lock files (``.NAME.lock``, kept on purpose: removing a
    held lock would let two builds of one engine run at once)."""
    return sorted(p.name for p in directory.iterdir() if not (p.name.startswith(".") and p.name.endswith(".lock")))


def tier_python(env: str, venv: str, setup: str) -> str:
    """An engine tier's interpreter: ``$env``, else its own virtualenv, which ``scripts/<setup>`` makes."""
    python = os.environ.get(env) or str(Path(__file__).resolve().parents[1] / venv / "bin" / "python")
    if not Path(python).exists():
        missing_tool(
            f"interpreter not found at {python}: run `bash scripts/{setup}` (scripts/test.sh does it before the tests)"
        )
    return python


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """vLLM's interpreter for the vLLM tier (vLLM's CPU build)."""
    return tier_python("SPECDEC_VLLM_PYTHON", ".venv-vllm", "setup_vllm.sh")


@pytest.fixture(scope="session")
def interchange_python() -> str:
    """The interchange tier's interpreter, where SpecForge and speculators are installed."""
    venv = os.environ.get("SPECDEC_INTERCHANGE_VENV", ".venv-interchange")  # where its set-up script makes it
    return tier_python("SPECDEC_INTERCHANGE_PYTHON", venv, "setup_interchange.sh")


def sglang_python() -> str:
    """SGLang's interpreter for the SGLang tier (SGLang's argument code and model registry)."""
    return tier_python("SPECDEC_SGLANG_PYTHON", ".venv-sglang", "setup_sglang.sh")


def chi_square_pvalue(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Goodness of fit; cells expected below 5 counts are pooled; impossible cells must stay empty."""
    observed, expected_probs = observed.flatten().double(), expected_probs.flatten()
    zero = expected_probs < 1e-12
    assert observed[zero].sum() == 0, f"sampled tokens the target forbids: {observed[zero].sum()} draws"
    expected = expected_probs * observed.sum()
    small = expected < 5
    obs = torch.cat([observed[~small & ~zero], observed[small & ~zero].sum()[None]])
    exp = torch.cat([expected[~small & ~zero], expected[small & ~zero].sum()[None]])
    keep = exp > 0
    return float(
        stats.chisquare(obs[keep].numpy(), exp[keep].numpy() * obs[keep].sum().item() / exp[keep].sum().item()).pvalue
    )


@pytest.fixture
def own_kernel_cache(tmp_path, monkeypatch):
    """The kit's CPU operators, and the graphs rewritten for them, built in a cache of this test's own."""
    from specdec_kit.runtime.ort.custom_ops import forget_library

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    forget_library()
    yield
    forget_library()
