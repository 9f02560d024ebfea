"""The router: tokenizer, request lifecycle, page pool, scheduler and shard fan-out. No torch here.

Four rooms, imports running one way (tests/test_layering.py enforces it):

- `core/`: the engine and what it runs on: sequences, the scheduler (policy), the KV manager (a
  sequence's pages) over the page pool and prefix index, the step loop, the shard group and the
  replica's connection to it. No server code, no FastAPI, no public API types.
- `requests/`: one request path for every front end: validation, tokenizing, constraint
  compiling, limits, a request made a sequence (admission).
- `api/`: the front ends: gRPC Generation, the Fleet stream to gateways, the OpenAI API.
- `observers/`: what watches the engine's events: Stats counters, Prometheus metrics, traces.

`app.py`, the router process, composes them.
"""
