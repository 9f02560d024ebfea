"""The router's front ends: gRPC Generation (`generation.py`), the Fleet stream of its prefix
index (`fleet.py`) and the OpenAI-compatible HTTP API (`openai/`)."""
