"""Prometheus metrics of a running engine, in their own registry (so several engines can live in one process).

Gauges and counters are read from `stats()` (the engine's snapshot) when scraped; latency histograms are observed
by the engine loop as tokens come out. Names follow vLLM's where it has one, with a `jaxpaged_` prefix.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Seconds; CPU steps are slow, so the buckets reach a minute.
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)

# stats() key -> (metric name, help); gauges are read as they are, counters only grow.
_GAUGES = {
    "num_running": ("jaxpaged_num_requests_running", "Sequences in the running batch."),
    "num_waiting": ("jaxpaged_num_requests_waiting", "Sequences waiting for their first prefill."),
    "num_swapped": ("jaxpaged_num_requests_swapped", "Sequences swapped out to host memory."),
    "num_in_flight": ("jaxpaged_num_requests_in_flight", "Requests with a reader attached (the API layer's view)."),
    "num_used": ("jaxpaged_kv_blocks_used", "KV blocks referenced by live sequences."),
    "num_free": ("jaxpaged_kv_blocks_free", "KV blocks free or held only by the prefix cache (reusable)."),
    "num_blocks": ("jaxpaged_kv_blocks_total", "KV blocks in the pool."),
    "num_cached": ("jaxpaged_kv_blocks_cached", "KV blocks holding a prefix-cache entry (any refcount)."),
    "num_shared": ("jaxpaged_kv_blocks_shared", "KV blocks referenced by more than one sequence."),
    "num_cpu_used": ("jaxpaged_cpu_blocks_used", "Host (swap) blocks in use."),
    "kv_utilization": ("jaxpaged_kv_slot_utilization",
                       "Share of the allocated KV slots of running sequences that hold a token."),
    "spec_mean_accepted_length": ("jaxpaged_spec_decode_mean_accepted_length",
                                  "Speculative decoding: tokens a verifying sequence emits per step, on average "
                                  "(accepted proposals + 1)."),
}
_COUNTERS = {
    "preemptions_recompute": ("jaxpaged_preemptions_recompute", "Preemptions by recomputation."),
    "preemptions_swap": ("jaxpaged_preemptions_swap", "Preemptions by swapping to host memory."),
    "prefix_cache_queries": ("jaxpaged_prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("jaxpaged_prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "prompt_tokens": ("jaxpaged_prompt_tokens",
                      "Prompt tokens run through the model (prefix-cache hits excluded, recomputation included)."),
    "generation_tokens": ("jaxpaged_generation_tokens", "Tokens generated."),
    "finished_requests": ("jaxpaged_requests_finished", "Requests that finished (stop or length)."),
    "aborted_requests": ("jaxpaged_requests_aborted", "Requests aborted (client gone, shutdown)."),
    "failed_requests": ("jaxpaged_requests_failed", "Requests that failed inside the engine (their grammar, their "
                                                    "rows or step), the others going on."),
    "steps": ("jaxpaged_engine_steps", "Engine steps run."),
    "cow_copies": ("jaxpaged_kv_cow_copies", "Copy-on-write block copies."),
    "swapped_out_blocks": ("jaxpaged_kv_swapped_out_blocks", "Blocks swapped out to host memory."),
    "swapped_in_blocks": ("jaxpaged_kv_swapped_in_blocks", "Blocks swapped back in."),
    "spec_proposed_tokens": ("jaxpaged_spec_decode_num_draft_tokens", "Speculative decoding: tokens proposed."),
    "spec_accepted_tokens": ("jaxpaged_spec_decode_num_accepted_tokens",
                             "Speculative decoding: proposed tokens the model accepted."),
    "spec_verify_steps": ("jaxpaged_spec_decode_num_drafts", "Speculative decoding: sequence-steps that verified "
                                                             "proposals."),
}


class _StatsCollector:
    """Reads the engine's snapshot at scrape time. Keys missing from stats() are left out, not faked as 0."""

    def __init__(self, stats: Callable[[], dict]):
        self._stats = stats

    def collect(self):
        s = self._stats()
        for key, (name, doc) in _GAUGES.items():
            if key in s:
                yield GaugeMetricFamily(name, doc, value=float(s[key]))
        if s.get("num_blocks"):
            yield GaugeMetricFamily("jaxpaged_kv_cache_usage", "Share of the KV pool's blocks in use (0-1).",
                                    value=float(s.get("num_used", 0)) / float(s["num_blocks"]))
        for key, (name, doc) in _COUNTERS.items():
            if key in s:
                yield CounterMetricFamily(name, doc, value=float(s[key]))
        if "preemptions" in s:
            yield CounterMetricFamily("jaxpaged_preemptions", "Preemptions of either kind.",
                                      value=float(s["preemptions"]))


class EngineMetrics:
    """The registry `/metrics` serves, and the histograms the engine loop feeds."""

    def __init__(self, stats: Callable[[], dict]):
        self.registry = CollectorRegistry()
        self.registry.register(_StatsCollector(stats))
        r = self.registry
        self.time_to_first_token = Histogram("jaxpaged_time_to_first_token_seconds",
                                             "From arrival to the first generated token.", buckets=TTFT_BUCKETS,
                                             registry=r)
        self.inter_token_latency = Histogram("jaxpaged_inter_token_latency_seconds",
                                             "Between consecutive generated tokens of a request.",
                                             buckets=ITL_BUCKETS, registry=r)
        self.e2e_latency = Histogram("jaxpaged_e2e_request_latency_seconds", "From arrival to the last token.",
                                     buckets=E2E_BUCKETS, registry=r)
        self.finished = Counter("jaxpaged_request_success", "Finished sequences by finish reason.",
                                ["finish_reason"], registry=r)
        self.rejected = Counter("jaxpaged_requests_rejected", "Requests refused because the waiting queue was full.",
                                registry=r)
        self.step_errors = Counter("jaxpaged_engine_step_errors", "Engine steps that raised (their requests fail).",
                                   registry=r)

    def render(self) -> bytes:
        """The Prometheus text exposition format."""
        return generate_latest(self.registry)


__all__ = ["EngineMetrics"]
