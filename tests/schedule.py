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
    "test_vllm_engine.py": 635,
    "test_export_onnx.py": 193,
    "test_regeneration.py": 191,
    "test_parallel_training.py": 168,
    "test_smollm2.py": 143,
    "test_greedy_lossless.py": 130,
    "test_vllm_chart.py": 126,
    "test_loadtest.py": 116,
    "test_vllm_bench.py": 88,
    "test_llamacpp.py": 87,
    "test_helm.py": 85,
    "test_edge.py": 74,
    "test_registry.py": 66,
    "test_server_hardening.py": 53,
    "test_cli_and_bench.py": 48,
    "test_moa.py": 44,
    "test_serving.py": 44,
    "test_committed_zoo.py": 41,
    "test_sampling_distribution.py": 37,
    "test_distill.py": 35,
    "test_speculators_format.py": 29,
    "test_sglang_commands.py": 25,
    "test_install.py": 25,
    "test_foreign_features.py": 21,
    "test_engine_cache.py": 18,
    "test_third_party_clients.py": 17,
    "test_zoo_and_bench.py": 14,
    "test_tree_attention.py": 13,
    "test_verify_cost.py": 11,
    "test_width_cut.py": 11,
    "test_quantized_engines.py": 10,
    "test_lookup.py": 10,
    "test_dflash.py": 10,
    "test_export_sglang.py": 9,
    "test_training.py": 7,
    "test_cost_policy.py": 7,
    "test_export_cache.py": 5,
    "test_packed_matmul.py": 4,
    "test_prefix_cache.py": 4,
    "test_engine_rules.py": 4,
    "test_static_checks.py": 3,
    "test_bandwidth_state.py": 3,
    "test_layers.py": 2,
    "test_scale_plan.py": 2,
    "test_newcomer.py": 2,
    "test_graph_fusions.py": 2,
    "test_continuous_batching.py": 2,
    "test_lookup_bench.py": 2,
    "test_docs.py": 2,
    "test_trees.py": 1,
    "test_cycle_profile.py": 1,
    "test_export_vllm.py": 1,
    "test_generation.py": 1,
    "test_eagle3.py": 1,
    "test_proposal_sizing.py": 1,
}


def longest_first(items: list) -> list:
    """``items`` with whole modules moved, the longest module first; a module's own tests keep their order."""
    return sorted(items, key=lambda item: -MODULE_SECONDS.get(Path(str(item.fspath)).name, 0))
