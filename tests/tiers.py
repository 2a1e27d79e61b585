"""The test tiers and what a tier does when its tool is missing.

The engine and client tiers need tools of their own (vLLM's and SGLang's virtualenvs, guidellm's, a Helm CLI), which
``scripts/test.sh`` sets up before the full run. Where one is missing, its tests skip and say which set-up script
makes it; the full run (``SPECDEC_REQUIRE_TIERS=1``, set by ``scripts/test.sh`` and so by CI) fails instead, so a
broken set-up can never pass as skipped tests.
"""

from __future__ import annotations

import os

import pytest

# marker -> what its tests need; pyproject.toml declares the same markers, scripts/test.sh --fast leaves them out.
TIERS = {
    "vllm": "vLLM's CPU build (.venv-vllm, scripts/setup_vllm.sh): its server and offline engine run the kit's exports",
    "sglang": "SGLang's own argument code (.venv-sglang, scripts/setup_sglang.sh)",
    "helm": "a real Helm CLI (.tools/helm, scripts/setup_helm.sh): the chart rendered, linted and refused by Helm",
    "llamacpp": "llama.cpp's llama-server and converter (.tools/llama.cpp, scripts/setup_llamacpp.sh)",
    "interchange": "SpecForge's and speculators' own dataset readers (.venv-interchange, scripts/setup_interchange.sh)",
    "clients": "real third-party clients against the kit's server: guidellm, Locust, schemathesis",
    "slow": "whole benchmarks, installs and trainings: more than about 20 s each on 2 cores",
}


def tiers_required() -> bool:
    return os.environ.get("SPECDEC_REQUIRE_TIERS", "") not in ("", "0")


def missing_tool(message: str) -> None:
    """A tier's tool is not there: fail in the full run, skip elsewhere (both say how to get it)."""
    if tiers_required():
        pytest.fail(message)
    pytest.skip(message)
