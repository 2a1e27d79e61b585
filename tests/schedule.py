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
    "test_vllm_engine.py": 809,
    "test_registry.py": 349,
    "test_export_onnx.py": 335,
    "test_loadtest.py": 292,
    "test_vllm_chart.py": 276,
    "test_greedy_lossless.py": 246,
    "test_parallel_training.py": 217,
    "test_vllm_bench.py": 195,
    "test_helm.py": 183,
    "test_edge.py": 162,
    "test_regeneration.py": 140,
    "test_moa.py": 111,
    "test_smollm2.py": 101,
    "test_server_hardening.py": 100,
    "test_distill.py": 94,
    "test_quantized_engines.py": 91,
    "test_serving.py": 105,
    "test_sampling_distribution.py": 79,
    "test_committed_zoo.py": 67,
    "test_install.py": 62,
    "test_sglang_commands.py": 62,
    "test_foreign_features.py": 60,
    "test_llamacpp.py": 150,
    "test_cost_policy.py": 45,
    "test_cli_and_bench.py": 45,
    "test_third_party_clients.py": 35,
    "test_engine_cache.py": 31,
    "test_speculators_format.py": 60,
    "test_verify_cost.py": 24,
    "test_tree_attention.py": 24,
    "test_bandwidth_state.py": 15,
    "test_bandwidth_split.py": 2,
}


def longest_first(items: list) -> list:
    """``items`` with whole modules moved, the longest module first; a module's own tests keep their order."""
    return sorted(items, key=lambda item: -MODULE_SECONDS.get(Path(str(item.fspath)).name, 0))
