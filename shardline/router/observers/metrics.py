"""The router's Prometheus metrics, under a `shardline:` prefix with the names vLLM users know, and
the gauges an endpoint picker reads from vLLM under vLLM's own `vllm:` names.

The router aggregates what the shards report (each step's compute time comes back in its
`StepOutcome`), so one scrape target describes the whole replica; shards expose no endpoint.

Counters and histograms move when the engine reports a request's or a step's events
(`RequestEvents`); gauges are read from the engine's load and page pool at scrape time, so they cost
nothing between scrapes. A counter never goes backwards: a replica reconnect starts a fresh page
pool, but the counters here are the router's own.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from shardline.router.core.events import RequestEvents
from shardline.router.core.sequence import Ending, Sequence, ending_label

# Buckets in seconds, from vLLM's: first tokens and whole requests take seconds on a CPU, a token
# or a step tens of milliseconds.
LATENCY_S = (
    0.001,
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
    160.0,
    640.0,
)
REQUEST_S = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
)


class Metrics(RequestEvents):
    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        p = "shardline:"
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Generated tokens", registry=r)
        self.cache_queries = Counter(
            p + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache", registry=r
        )
        self.cache_hits = Counter(p + "prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=r)
        self.finished_requests = Counter(
            p + "request_finished", "Requests ended, by finish reason", ["finished_reason"], registry=r
        )
        self.ttft = Histogram(
            p + "time_to_first_token_seconds", "From arrival to the first token", buckets=LATENCY_S, registry=r
        )
        self.itl = Histogram(
            p + "inter_token_latency_seconds", "Between consecutive tokens of a request", buckets=LATENCY_S, registry=r
        )
        self.e2e = Histogram(
            p + "e2e_request_latency_seconds", "From arrival to the last token", buckets=REQUEST_S, registry=r
        )
        self.queue_time = Histogram(
            p + "request_queue_time_seconds", "From arrival to admission", buckets=REQUEST_S, registry=r
        )
        self.prefill_time = Histogram(
            p + "request_prefill_time_seconds", "From admission to the first token", buckets=REQUEST_S, registry=r
        )
        self.decode_time = Histogram(
            p + "request_decode_time_seconds", "From the first token to the last", buckets=REQUEST_S, registry=r
        )
        self.step_time = Histogram(
            p + "step_duration_seconds",
            "A step's round trip as the router sees it",
            ["phase"],
            buckets=LATENCY_S,
            registry=r,
        )
        self.shard_step_time = Histogram(
            p + "shard_step_duration_seconds",
            "A step's compute time as the shards report it (the slowest rank)",
            ["phase"],
            buckets=LATENCY_S,
            registry=r,
        )

        # Speculative decoding, under vLLM's names (its spec_decode_* counters)
        self.spec_drafts = Counter(p + "spec_decode_num_drafts", "Verifications of proposed tokens", registry=r)
        self.spec_draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "Tokens proposed", registry=r)
        self.spec_accepted_tokens = Counter(
            p + "spec_decode_num_accepted_tokens", "Proposed tokens the target accepted", registry=r
        )

    def watch(self, replica) -> None:
        """Gauges (and the replica's failure counts) read from `replica` at scrape time."""
        self.registry.register(_AtScrape(replica))

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        start_http_server(port, addr=host, registry=self.registry)

    # -- events -----------------------------------------------------------------------------------
    def admitted(self, seq: Sequence) -> None:
        self.queue_time.observe(seq.admitted_at - seq.arrival)
        self.prompt_tokens.inc(len(seq.prompt_ids))
        self.cache_queries.inc(len(seq.prompt_ids))  # as the page pool counts them (a scored prompt hits 0)
        self.cache_hits.inc(seq.cached_prompt_tokens)

    def token(self, seq: Sequence, first: bool) -> None:
        self.generation_tokens.inc()
        if first:
            self.ttft.observe(seq.first_token_at - seq.arrival)
            self.prefill_time.observe(seq.first_token_at - seq.admitted_at)
        else:
            self.itl.observe(seq.last_token_at - seq.previous_token_at)

    def finished(self, seq: Sequence, end: Ending) -> None:
        self.finished_requests.labels(ending_label(end)).inc()
        if seq.last_token_at is not None:
            self.e2e.observe(seq.last_token_at - seq.arrival)
            self.decode_time.observe(seq.last_token_at - seq.first_token_at)

    def step_done(self, step_id: int, step, result, wall_s: float) -> None:
        self.step_time.labels(step.phase.value).observe(wall_s)
        self.shard_step_time.labels(step.phase.value).observe(result.compute_ms / 1e3)
        if proposed := step.proposed:
            self.spec_drafts.inc(sum(1 for s in step.scheduled if s.proposals))
            self.spec_draft_tokens.inc(proposed)
            self.spec_accepted_tokens.inc(step.accepted)


class _AtScrape:
    def __init__(self, replica):
        self.replica = replica

    def collect(self):
        replica, p = self.replica, "shardline:"
        yield CounterMetricFamily(p + "shard_failures", "Times the shard group failed", replica.failures)
        yield CounterMetricFamily(p + "shard_recoveries", "Times the shard group came back", replica.recoveries)
        load, pool = replica.load(), replica.pool
        running = GaugeMetricFamily(p + "num_requests_running", "Requests admitted (prefilling or decoding)")
        waiting = GaugeMetricFamily(p + "num_requests_waiting", "Requests waiting for admission")
        prefilling = GaugeMetricFamily(p + "num_requests_prefilling", "Admitted requests still prefilling")
        usage = GaugeMetricFamily(p + "kv_cache_usage_perc", "Share of KV pages referenced or reserved, 0 to 1")
        pages = GaugeMetricFamily(p + "kv_cache_pages", "KV pages by state", labels=["state"])
        window = GaugeMetricFamily(
            p + "kv_window_pages", "Pages of the sliding-window layers' own pool by state", labels=["state"]
        )
        if replica.window_pool is not None:
            for state in ("referenced", "reserved", "evictable", "free"):
                window.add_metric([state], getattr(replica.window_pool, state))
        if load is not None:
            running.add_metric([], load.running)
            waiting.add_metric([], load.waiting)
            prefilling.add_metric([], load.prefilling)
            usage.add_metric([], (pool.referenced + pool.reserved) / pool.num_pages if pool.num_pages else 0.0)
            for state in ("referenced", "reserved", "evictable", "free"):
                pages.add_metric([state], getattr(pool, state))
        yield from (running, waiting, prefilling, usage, pages, window)
        yield from _vllm_named(load, pool)


def _vllm_named(load, pool):
    """The gauges an inference gateway's endpoint picker reads from a vLLM server, under vLLM's
    names and labels, so that it picks among Shardline replicas as it would among vLLM pods (the
    Gateway API Inference Extension's defaults for vLLM: requests waiting and running, KV cache
    usage, the LoRA adapters' info and the cache config's block size and block count; a missing
    one is an error at each scrape there). vLLM's usage counts the blocks in use; ours the pages
    referenced or reserved, what admission cannot give to another request."""
    waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting to be processed")
    running = GaugeMetricFamily("vllm:num_requests_running", "Requests in model execution batches")
    usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
    config = GaugeMetricFamily(
        "vllm:cache_config_info", "Information of the KV cache config", labels=["block_size", "num_gpu_blocks"]
    )
    lora = GaugeMetricFamily(
        "vllm:lora_requests_info",
        "Running stats on LoRA requests (Shardline serves no adapters)",
        labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
    )
    if load is not None:
        waiting.add_metric([], load.waiting)
        running.add_metric([], load.running)
        usage.add_metric([], (pool.referenced + pool.reserved) / pool.num_pages if pool.num_pages else 0.0)
        config.add_metric([str(pool.page_size), str(pool.num_pages)], 1.0)
    lora.add_metric(["0", "", ""], time.time())  # vLLM's value: when the adapters' state was taken
    yield from (waiting, running, usage, config, lora)
