"""Traces and metrics, end to end: real `shardline serve` processes exporting to a real OTLP/gRPC
receiver, and the router's Prometheus endpoint scraped over HTTP."""

import secrets
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.otlp_receiver import OtlpReceiver
from harness.serve import free_port
from shardline.protos import generation_pb2 as pb
from tests.support import Server, wait_for

pytestmark = pytest.mark.processes  # every test here starts processes

PROMPT = list(range(5, 15))  # 10 tokens: chunks of 4, 4 and 2
NEW_TOKENS = 5
# Batches leave every 50 ms, so spans arrive while the test waits for them.
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50", "OTEL_TRACES_SAMPLER": "always_on"}


def traced_server(tiny_models, receiver, *layout: str, metrics_port: int | None = None) -> Server:
    extra = ["--metrics-port", str(metrics_port)] if metrics_port else []
    return Server(
        "--model",
        str(tiny_models["llama"]),
        "--page-size",
        "16",
        "--chunk-size",
        "4",
        "--otlp-endpoint",
        receiver.endpoint,
        *layout,
        *extra,
        env=FAST_EXPORT,
    )


def generate_traced(server: Server) -> tuple[str, str, list[int], pb.GenerateResponse]:
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    tokens, last = [], None
    for msg in server.stub.Generate(
        pb.GenerateRequest(prompt_token_ids=pb.PromptTokens(ids=PROMPT), max_new_tokens=NEW_TOKENS, ignore_eos=True),
        metadata=[("traceparent", f"00-{trace_id}-{parent_id}-01")],
        timeout=120,
    ):
        tokens += msg.token_ids
        last = msg
    return trace_id, parent_id, tokens, last


@pytest.mark.parametrize(
    "layout,ranks", [(("--tp", "2"), {(0, 0), (1, 0)}), (("--pp", "2"), {(0, 0), (0, 1)})], ids=["tp2", "pp2"]
)
def test_a_request_trace_reaches_every_step_and_every_shard_rank(tiny_models, layout, ranks):
    with OtlpReceiver() as receiver:
        server = traced_server(tiny_models, receiver, *layout)
        try:
            trace_id, parent_id, tokens, last = generate_traced(server)

            def request_span():
                return next((s for s in receiver.spans() if s.trace_id == trace_id), None)

            request = wait_for(request_span, 30, "the request span")
            steps = [s for s in receiver.spans() if (request.trace_id, request.span_id) in s.links]

            def shard_children():  # every rank's child span of every step that served the request
                spans = receiver.spans()
                out = {}
                for step in steps:
                    out[step.span_id] = {
                        (c.attributes["shardline.tp_rank"], c.attributes["shardline.pp_stage"])
                        for c in spans
                        if c.parent_span_id == step.span_id and c.trace_id == step.trace_id and c.name == "shard step"
                    }
                return out if all(v == ranks for v in out.values()) else None

            children = wait_for(shard_children, 30, "a shard span per rank under every step")
        finally:
            assert server.stop() == 0
    assert len(tokens) == NEW_TOKENS
    # The request span continues the client's trace, per the GenAI conventions.
    assert request.parent_span_id == parent_id
    assert request.resource["service.name"] == "shardline-router"
    a = request.attributes
    assert request.name == f"text_completion {a['gen_ai.request.model']}"
    assert a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.usage.input_tokens"] == len(PROMPT) == last.usage.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == NEW_TOKENS
    assert a["gen_ai.usage.cache_read.input_tokens"] == 0
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["gen_ai.request.max_tokens"] == NEW_TOKENS
    assert a["shardline.request.cache_salt_present"] is False
    events = [name for name, _ in request.events]
    assert events == [
        "queued",
        "admitted",
        "prefill_chunk",
        "prefill_chunk",
        "prefill_chunk",
        "first_token",
        "finished",
    ]
    # Every step that served it: three prefill chunks, then a decode step per token after the first.
    phases = sorted(s.attributes["shardline.step.phase"] for s in steps)
    assert phases == ["admit", "continue", "continue"] + ["decode"] * (NEW_TOKENS - 1)
    assert all(s.trace_id != trace_id and s.parent_span_id == "" for s in steps)  # roots of their own traces
    assert len(children) == len(steps) == 3 + NEW_TOKENS - 1
    shard_resources = {c.resource["service.instance.id"] for c in receiver.spans() if c.name == "shard step"}
    assert len(shard_resources) == len(ranks)  # each rank's process tells itself apart


def scrape(port: int) -> dict[str, float]:
    """Every sample of the endpoint: 'name{label="v"}' (labels sorted) or 'name' -> value."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "le")
            if "le" in s.labels:
                continue
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def test_metrics_move_by_exactly_what_was_served(tiny_models):
    port = free_port()
    server = Server("--model", str(tiny_models["llama"]), "--page-size", "4", "--metrics-port", str(port))
    try:
        before = scrape(port)
        usages = []
        for _ in range(2):  # the second request finds the first one's full pages cached
            _, _, last = server.generate(
                prompt_token_ids=pb.PromptTokens(ids=PROMPT), max_new_tokens=NEW_TOKENS, ignore_eos=True
            )
            usages.append(last.usage)
        server.wait_idle()
        after = scrape(port)
    finally:
        assert server.stop() == 0

    def moved(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    p = "shardline:"
    assert usages[1].cached_prompt_tokens == 8
    assert moved(p + "generation_tokens_total") == sum(u.completion_tokens for u in usages) == 2 * NEW_TOKENS
    assert moved(p + "prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert moved(p + "prefix_cache_queries_total") == 2 * len(PROMPT)
    assert moved(p + "prefix_cache_hits_total") == sum(u.cached_prompt_tokens for u in usages)
    assert moved(p + 'request_finished_total{finished_reason="length"}') == 2
    for name in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
    ):
        assert moved(p + name + "_count") == 2, name
    assert moved(p + "inter_token_latency_seconds_count") == 2 * (NEW_TOKENS - 1)
    assert moved(p + 'step_duration_seconds_count{phase="decode"}') == 2 * (NEW_TOKENS - 1)
    assert moved(p + 'shard_step_duration_seconds_count{phase="admit"}') == 2
    assert after[p + "num_requests_running"] == after[p + "num_requests_waiting"] == 0
    assert after[p + "kv_cache_usage_perc"] == 0
    assert after[p + 'kv_cache_pages{state="referenced"}'] == after[p + 'kv_cache_pages{state="reserved"}'] == 0
    assert after[p + 'kv_cache_pages{state="evictable"}'] > 0
    assert after[p + "shard_failures_total"] == 0
