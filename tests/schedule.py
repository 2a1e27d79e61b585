"""The order in which test processes take modules: the longest first.

Under pytest-xdist (``SPECDEC_TEST_WORKERS``, ``--dist loadfile``) a module runs whole in one process, and a process
that finishes takes the next module in collection order. Started first, the long modules (vLLM servers, engine
builds, installs) run beside each other and the short ones fill the gaps at the end; left last, one long module runs
alone while the other process idles. The seconds are one process's module times on 2 cores (``bash scripts/test.sh
-q --durations=0``, calls and fixtures summed per module); a module missing here runs after these, in its own order.
"""

from __future__ import annotations

from pathlib import Path

MODULE_SECONDS = {
    "test_vllm_engine.py": 581,
    "test_export_onnx.py": 209,
    "test_vllm_chart.py": 169,
    "test_parallel_training.py": 161,
    "test_greedy_lossless.py": 145,
    "test_smollm2.py": 138,
    "test_regeneration.py": 127,
    "test_registry.py": 124,
    "test_helm.py": 114,
    "test_loadtest.py": 107,
    "test_vllm_bench.py": 91,
    "test_llamacpp.py": 90,
    "test_edge.py": 75,
    "test_moa.py": 67,
    "test_server_hardening.py": 56,
    "test_serving.py": 52,
    "test_sampling_distribution.py": 50,
    "test_committed_zoo.py": 41,
    "test_distill.py": 38,
    "test_quantized_engines.py": 38,
    "test_cli_and_bench.py": 31,
    "test_speculators_format.py": 30,
    "test_sglang_commands.py": 28,
    "test_foreign_features.py": 28,
    "test_install.py": 26,
    "test_third_party_clients.py": 17,
    "test_engine_cache.py": 16,
    "test_dflash.py": 15,
    "test_zoo_and_bench.py": 12,
    "test_export_sglang.py": 11,
    "test_verify_cost.py": 10,
    "test_lookup.py": 10,
    "test_tree_attention.py": 10,
}


def longest_first(items: list) -> list:
    """``items`` with whole modules moved, the longest module first; a module's own tests keep their order."""
    return sorted(items, key=lambda item: -MODULE_SECONDS.get(Path(str(item.fspath)).name, 0))
