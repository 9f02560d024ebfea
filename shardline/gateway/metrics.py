"""The gateway's Prometheus metrics (`--metrics-port`), under the routers' `shardline:` prefix with
a `gateway_` part, one series per replica (label `replica`: its router's address).

Every value is read at scrape time from what the gateway already keeps for `Stats.replicas` (the
replicas' counters and views of their caches), so the two never disagree and nothing moves
between scrapes. A replica that DNS no longer resolves drops out with its series; one that comes
back starts its counters from zero, which Prometheus reads as a counter reset.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

P = "shardline:gateway_"

# Per replica: (kind, name, help, value of a gateway/replicas.py Replica).
PER_REPLICA = [
    (GaugeMetricFamily, "replica_serving", "1 while the replica is routable", lambda r: int(r.serving)),
    (
        GaugeMetricFamily,
        "replica_cached_pages",
        "Page hashes the gateway knows the replica holds",
        lambda r: len(r.index),
    ),
    (
        GaugeMetricFamily,
        "replica_requests_running",
        "Requests running, as the replica reported",
        lambda r: r.load.requests_running,
    ),
    (
        GaugeMetricFamily,
        "replica_requests_waiting",
        "Requests waiting, as the replica reported",
        lambda r: r.load.requests_waiting,
    ),
    (CounterMetricFamily, "requests_routed", "Requests sent to the replica", lambda r: r.counters.requests_routed),
    (
        CounterMetricFamily,
        "predicted_cached_tokens",
        "Prompt tokens the gateway predicted the replica caches, summed over the requests sent there",
        lambda r: r.counters.predicted_cached_tokens,
    ),
    (
        CounterMetricFamily,
        "reported_cached_tokens",
        "Prompt tokens the replica reported it served from its cache",
        lambda r: r.counters.reported_cached_tokens,
    ),
    (
        CounterMetricFamily,
        "failovers",
        "Requests that failed on the replica before their first token and were sent to another",
        lambda r: r.counters.failovers,
    ),
]


class GatewayMetrics(Collector):
    def __init__(self, service):
        self.service = service  # a GatewayService: its replicas and its requests in flight

    def collect(self):
        service = self.service
        yield GaugeMetricFamily(
            P + "serving", "1 while the gateway takes requests (a replica is routable)", value=int(service.serving)
        )
        yield GaugeMetricFamily(
            P + "requests_in_flight", "Requests the gateway has open on the replicas", value=service.in_flight
        )
        replicas = list(service.replicas)
        for kind, name, doc, value in PER_REPLICA:
            family = kind(P + name, doc, labels=["replica"])
            for r in replicas:
                family.add_metric([r.address], value(r))
            yield family


def serve_metrics(service, port: int, host: str) -> None:
    registry = CollectorRegistry()
    registry.register(GatewayMetrics(service))
    start_http_server(port, addr=host, registry=registry)
