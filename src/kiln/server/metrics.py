"""Prometheus metrics for `kiln serve`, in a per-app CollectorRegistry (so tests can build several apps).

Engine-wide state (running/waiting requests, KV blocks, token totals, preemptions, prefix-cache hits)
is read from the latest `EngineStats` snapshot at scrape time; the engine loop stores a new snapshot
after every step, so a scrape never touches the engine from another thread. Latencies are histograms
the engine loop observes as tokens arrive.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kiln.engine.outputs import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# CPU steps of a 135M model take tens of ms, GPU steps a few: buckets span both
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class _EngineStatsCollector:
    """Exports the last EngineStats snapshot (set by the engine loop) as gauges and counters."""

    def __init__(self) -> None:
        self.stats = EngineStats()

    def collect(self):
        s = self.stats
        gauges = [
            ("kiln_requests_running", "sequences in the running batch", s.num_running),
            ("kiln_requests_waiting", "sequences waiting to be scheduled", s.num_waiting),
            ("kiln_kv_cache_blocks_used", "KV-cache blocks in use", s.kv_blocks_used),
            ("kiln_kv_cache_blocks_total", "KV-cache blocks in the pool", s.kv_blocks_total),
            (
                "kiln_kv_cache_usage_ratio",
                "fraction of KV-cache blocks in use",
                s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0,
            ),
            (
                "kiln_prefix_cache_hit_rate",
                "prompt tokens served from the prefix cache / prompt tokens looked up",
                s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0,
            ),
            (
                "kiln_spec_decode_acceptance_rate",
                "speculative decoding: proposed tokens the target accepted / tokens proposed",
                s.spec_accepted_tokens / s.spec_proposed_tokens if s.spec_proposed_tokens else 0.0,
            ),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        counters = [
            ("kiln_prompt_tokens", "prompt tokens added to the engine", s.prompt_tokens_total),
            ("kiln_generation_tokens", "tokens generated", s.generation_tokens_total),
            ("kiln_preemptions", "sequences preempted to free KV blocks", s.num_preemptions),
            (
                "kiln_prefix_cache_queries",
                "prompt tokens looked up in the prefix cache",
                s.prefix_cache_queries,
            ),
            (
                "kiln_prefix_cache_hits",
                "prompt tokens whose KV came from the prefix cache",
                s.prefix_cache_hits,
            ),
            (
                "kiln_spec_decode_proposed_tokens",
                "speculative decoding: tokens proposed",
                s.spec_proposed_tokens,
            ),
            (
                "kiln_spec_decode_accepted_tokens",
                "speculative decoding: proposed tokens the target accepted",
                s.spec_accepted_tokens,
            ),
            (
                "kiln_spec_decode_verify_steps",
                "speculative decoding: sequence-steps that verified proposals",
                s.spec_verify_steps,
            ),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)


class ServerMetrics:
    """All of one app's metrics. `render()` gives the Prometheus text format."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._engine = _EngineStatsCollector()
        self.registry.register(self._engine)
        self.ttft = Histogram(
            "kiln_time_to_first_token_seconds",
            "arrival to first generated token",
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "kiln_inter_token_latency_seconds",
            "time between consecutive generated tokens of a sequence",
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e_latency = Histogram(
            "kiln_request_latency_seconds",
            "arrival to finish, per sequence",
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.requests_finished = Counter(
            "kiln_requests_finished",
            "sequences finished, by finish reason",
            ["finish_reason"],
            registry=self.registry,
        )
        self.requests_aborted = Counter(
            "kiln_requests_aborted",
            "sequences aborted because their client went away before they finished",
            registry=self.registry,
        )
        self.requests_rejected = Counter(
            "kiln_requests_rejected",
            "HTTP requests answered with an error, by status code",
            ["status"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "kiln_server_sequences_in_flight",
            "sequences admitted by the server and not yet answered (running + queued)",
            registry=self.registry,
        )
        self.capacity = Gauge(
            "kiln_server_sequences_capacity",
            "most sequences admitted at once (max_num_seqs + max_queue); more get 503",
            registry=self.registry,
        )
        self.engine_errors = Counter("kiln_engine_errors", "engine steps that raised", registry=self.registry)
        self.kv_cache_info = Gauge(
            "kiln_kv_cache_info",
            "the KV cache's element dtype and tokens per block (value 1; blocks: kiln_kv_cache_blocks_total)",
            ["dtype", "block_size"],
            registry=self.registry,
        )
        self.kv_cache_exact_blocks = Gauge(
            "kiln_kv_cache_exact_blocks_total",
            "float16 blocks holding an fp8 cache's exact positions (first blocks, recent windows); 0 without",
            registry=self.registry,
        )
        self.kv_cache_exact_window = Gauge(
            "kiln_kv_cache_exact_window",
            "recent positions per sequence an fp8 cache keeps exact (its first block too); -1 without",
            registry=self.registry,
        )

    def set_kv_cache(
        self, dtype: str, block_size: int, exact_blocks: int = 0, exact_window: int = -1
    ) -> None:
        """Record the KV cache's dtype name ("float8_e4m3fn", "bfloat16", ...) and block size, and an fp8
        cache's exact blocks and window (kiln.engine.exact_kv; 0 and -1 without)."""
        self.kv_cache_info.labels(dtype, str(block_size)).set(1)
        self.kv_cache_exact_blocks.set(exact_blocks)
        self.kv_cache_exact_window.set(exact_window)

    def set_engine_stats(self, stats: EngineStats) -> None:
        self._engine.stats = stats

    @property
    def engine_stats(self) -> EngineStats:
        return self._engine.stats

    def render(self) -> bytes:
        return generate_latest(self.registry)
