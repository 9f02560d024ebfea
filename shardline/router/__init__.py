"""The router: tokenizer, request lifecycle, page pool, scheduler and shard fan-out. No torch here.

Five rooms, imports running one way (tests/test_layering.py enforces it):

- `core/`: the engine and what it runs on: sequences, the scheduler (policy), the KV manager (a
  sequence's pages) over the page pool and prefix index, the step loop, and the replica's
  connection to its shard group, all in plain types. No server code, no FastAPI, no gRPC, no
  protobuf.
- `shards/`: the shard group on the wire: its gRPC streams, and the codec between the core's
  steps and results and shard.proto's.
- `requests/`: one request path for every front end: validation, tokenizing, constraint
  compiling, limits, a request made a sequence (admission).
- `api/`: the front ends: gRPC Generation, the Fleet stream to gateways, the OpenAI API.
- `observers/`: what watches the engine's events: Stats counters, Prometheus metrics, traces.

`app.py`, the router process, composes them.
"""
