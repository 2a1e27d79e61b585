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
    "test_vllm_engine.py": 587,
    "test_export_onnx.py": 250,
    "test_parallel_training.py": 182,
    "test_vllm_chart.py": 165,
    "test_smollm2.py": 165,
    "test_greedy_lossless.py": 158,
    "test_registry.py": 150,
    "test_regeneration.py": 141,
    "test_loadtest.py": 116,
    "test_helm.py": 114,
    "test_llamacpp.py": 102,
    "test_vllm_bench.py": 83,
    "test_server_hardening.py": 82,
    "test_edge.py": 62,
    "test_serving.py": 55,
    "test_cli_and_bench.py": 55,
    "test_sampling_distribution.py": 50,
    "test_moa.py": 50,
    "test_committed_zoo.py": 46,
    "test_quantized_engines.py": 44,
    "test_distill.py": 39,
    "test_speculators_format.py": 35,
    "test_install.py": 31,
    "test_sglang_commands.py": 30,
    "test_export_cache.py": 25,
    "test_foreign_features.py": 24,
    "test_engine_cache.py": 19,
    "test_third_party_clients.py": 18,
    "test_zoo_and_bench.py": 15,
    "test_tree_attention.py": 15,
    "test_dflash.py": 15,
    "test_lookup.py": 14,
    "test_verify_cost.py": 12,
    "test_width_cut.py": 12,
    "test_engine_rules.py": 10,
    "test_training.py": 9,
    "test_export_sglang.py": 9,
    "test_cost_policy.py": 7,
    "test_packed_matmul.py": 6,
    "test_static_checks.py": 5,
    "test_prefix_cache.py": 5,
    "test_layers.py": 5,
    "test_scale_plan.py": 3,
    "test_newcomer.py": 3,
    "test_trees.py": 3,
    "test_bandwidth_state.py": 2,
    "test_docs.py": 2,
    "test_lookup_bench.py": 2,
    "test_graph_fusions.py": 2,
    "test_continuous_batching.py": 2,
    "test_export_vllm.py": 1,
    "test_generation.py": 1,
    "test_trtllm_interface.py": 1,
    "test_eagle3.py": 1,
    "test_proposal_sizing.py": 1,
}


def longest_first(items: list) -> list:
    """``items`` with whole modules moved, the longest module first; a module's own tests keep their order."""
    return sorted(items, key=lambda item: -MODULE_SECONDS.get(Path(str(item.fspath)).name, 0))
