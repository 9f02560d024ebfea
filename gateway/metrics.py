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


class GatewayMetrics(Collector):
    def __init__(self, service):
        self.service = service  # a GatewayService: its replicas and its requests in flight

    def collect(self):
        service = self.service
        yield GaugeMetricFamily(P + "serving", "1 while the gateway takes requests (a replica is routable)",
                                value=int(service.serving))
        yield GaugeMetricFamily(P + "requests_in_flight", "Requests the gateway has open on the replicas",
                                value=service.in_flight)
        families = {
            "serving": GaugeMetricFamily(P + "replica_serving", "1 while the replica is routable", labels=["replica"]),
            "pages": GaugeMetricFamily(P + "replica_cached_pages", "Page hashes the gateway knows the replica holds",
                                       labels=["replica"]),
            "running": GaugeMetricFamily(P + "replica_requests_running", "Requests running, as the replica reported",
                                         labels=["replica"]),
            "waiting": GaugeMetricFamily(P + "replica_requests_waiting", "Requests waiting, as the replica reported",
                                         labels=["replica"]),
            "routed": CounterMetricFamily(P + "requests_routed", "Requests sent to the replica", labels=["replica"]),
            "predicted": CounterMetricFamily(P + "predicted_cached_tokens", "Prompt tokens the gateway predicted "
                                             "the replica caches, summed over the requests sent there",
                                             labels=["replica"]),
            "reported": CounterMetricFamily(P + "reported_cached_tokens", "Prompt tokens the replica reported "
                                            "it served from its cache", labels=["replica"]),
            "failovers": CounterMetricFamily(P + "failovers", "Requests that failed on the replica before their "
                                             "first token and were sent to another", labels=["replica"]),
        }
        for r in service.replicas:
            c, label = r.counters, [r.address]
            for key, value in (("serving", int(r.serving)), ("pages", len(r.index)),
                               ("running", r.load.requests_running), ("waiting", r.load.requests_waiting),
                               ("routed", c.requests_routed), ("predicted", c.predicted_cached_tokens),
                               ("reported", c.reported_cached_tokens), ("failovers", c.failovers)):
                families[key].add_metric(label, value)
        yield from families.values()


def serve_metrics(service, port: int, host: str) -> None:
    registry = CollectorRegistry()
    registry.register(GatewayMetrics(service))
    start_http_server(port, addr=host, registry=registry)
