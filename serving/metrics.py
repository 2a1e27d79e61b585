"""Prometheus metrics in the style of vLLM and SGLang (``specdec:`` prefix, same names and meanings).

Queue depth (``specdec:num_requests_waiting``) is what the chart autoscales on; latency histograms are
per token where the name says so (a speculative cycle that emits k tokens at once records k inter-token
latencies of a k-th of the gap each, as a client reading the stream sees them); the speculative
counters follow vLLM's ``spec_decode`` family, and ``specdec:spec_accept_length`` is SGLang's gauge.
"""

from __future__ import annotations

import gc

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class ServerMetrics:
    def __init__(self, model: str):
        self.registry = CollectorRegistry()
        r, label = self.registry, ["model_name"]
        # the process's own families, as vLLM's endpoint has them: python_gc_collections_total{generation="2"} counts
        # the full collections, each a stall inside some cycle of the batch; the start-up heap is frozen out of them
        GCCollector(registry=r)
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        self.frozen = Gauge(
            "specdec:gc_frozen_objects",
            "Objects frozen out of the garbage collector's walks at start-up (runtime/heap.py)",
            registry=r,
        )
        self.frozen.set_function(gc.get_freeze_count)
        self.running = Gauge("specdec:num_requests_running", "Requests in the running batch", label, registry=r)
        self.waiting = Gauge("specdec:num_requests_waiting", "Requests waiting in the queue", label, registry=r)
        self.kv_usage = Gauge(
            "specdec:kv_cache_usage_perc",
            "KV-cache use, 0-1: tokens held by the running batch over max-num-seqs x the engine's "
            "context (vLLM's kv_cache_usage_perc; the endpoint picker reads it)",
            label,
            registry=r,
        )
        self.ttft = Histogram(
            "specdec:time_to_first_token_seconds", "Time to first token", label, buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "specdec:inter_token_latency_seconds",
            "Inter-token latency, per token",
            label,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "specdec:e2e_request_latency_seconds", "End-to-end request latency", label, buckets=E2E_BUCKETS, registry=r
        )
        self.queue_time = Histogram(
            "specdec:request_queue_time_seconds",
            "Time spent waiting in the queue",
            label,
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("specdec:prompt_tokens", "Prompt tokens processed", label, registry=r)
        self.prefix_queries = Counter(
            "specdec:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache (vLLM's prefix_cache_queries)",
            label,
            registry=r,
        )
        self.prefix_hits = Counter(
            "specdec:prefix_cache_hits",
            "Prompt tokens whose keys and values came from the prefix cache",
            label,
            registry=r,
        )
        self.folded_prompts = Counter(
            "specdec:prompts_read_in_decode",
            "Requests whose prompt a decode cycle's target call read (no prefill call of their own)",
            label,
            registry=r,
        )
        self.generation_tokens = Counter("specdec:generation_tokens", "Tokens generated", label, registry=r)
        self.success = Counter("specdec:request_success", "Finished requests", label + ["finished_reason"], registry=r)
        self.errors = Counter("specdec:request_errors", "Failed requests by error type", label + ["type"], registry=r)
        self.drafts = Counter(
            "specdec:spec_decode_num_drafts", "Speculative cycles (one per request per cycle)", label, registry=r
        )
        self.draft_tokens = Counter(
            "specdec:spec_decode_num_draft_tokens", "Draft tokens sent to verification", label, registry=r
        )
        self.accepted = Counter("specdec:spec_decode_num_accepted_tokens", "Draft tokens accepted", label, registry=r)
        self.accepted_per_pos = Counter(
            "specdec:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each tree depth",
            label + ["position"],
            registry=r,
        )
        self.accept_length = Gauge(
            "specdec:spec_accept_length",
            "Mean acceptance length (accepted drafts + bonus token per speculative cycle)",
            label,
            registry=r,
        )
        # the same per drafting method: a hybrid engine's merged trees, its head alone or its model-free draft alone
        method = label + ["method"]
        self.method_drafts = Counter(
            "specdec:spec_decode_num_drafts_by_method", "Speculative cycles per request, by method", method, registry=r
        )
        self.method_draft_tokens = Counter(
            "specdec:spec_decode_num_draft_tokens_by_method", "Draft tokens verified, by method", method, registry=r
        )
        self.method_accepted = Counter(
            "specdec:spec_decode_num_accepted_tokens_by_method", "Draft tokens accepted, by method", method, registry=r
        )
        self.tree_tokens = Gauge(
            "specdec:spec_tree_tokens", "Tree size of the last cycle (1 = speculation off)", label, registry=r
        )
        self.model = model
        self._acc_total = 0
        self._drafts_total = 0

    def labels(self, metric, **extra):
        return metric.labels(model_name=self.model, **extra)

    def record_speculation(
        self, drafts: int, draft_tokens: int, accepted: int, per_depth: list[int], method: str = ""
    ) -> None:
        """One cycle's speculation over ``drafts`` requests; ``method``: the draft that proposed (its kind, a
        hybrid's ``head+lookup``, or one part of it)."""
        if drafts == 0:
            return
        self.labels(self.drafts).inc(drafts)
        self.labels(self.draft_tokens).inc(draft_tokens)
        self.labels(self.accepted).inc(accepted)
        if method:
            self.labels(self.method_drafts, method=method).inc(drafts)
            self.labels(self.method_draft_tokens, method=method).inc(draft_tokens)
            self.labels(self.method_accepted, method=method).inc(accepted)
        for depth, count in enumerate(per_depth):
            if count:
                self.labels(self.accepted_per_pos, position=str(depth)).inc(count)
        self._acc_total += accepted
        self._drafts_total += drafts
        self.labels(self.accept_length).set(1.0 + self._acc_total / self._drafts_total)
