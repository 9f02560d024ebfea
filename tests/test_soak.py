"""A short soak (bench/soak.py's workload, 8 s on a tiny model): many streams with random
cancels, deadlines, dropped connections and three SIGKILLed clients lose nothing and leave
nothing behind."""

import asyncio

import pytest

from harness.soak import SoakArgs, run_soak
from tests.support import Server

pytestmark = pytest.mark.processes  # every test here starts processes


def test_a_short_soak_loses_nothing(tiny_models):
    server = Server(
        "--model",
        str(tiny_models["llama"]),
        "--page-size",
        "16",
        "--num-pages",
        "512",
        "--max-batch",
        "16",
        "--max-waiting",
        "128",
    )
    try:
        args = SoakArgs(streams=40, duration_s=8, silent_s=10, kill_every_s=2.5, request_timeout_s=60)
        result = asyncio.run(run_soak(server.target, args))
        pool, statuses = result["end_pool"], result["statuses"]
        assert pool["pages_referenced"] == 0 and pool["pages_reserved"] == 0
        assert pool["pages_free"] + pool["pages_evictable"] == pool["pages_total"]
        assert pool["requests_running"] == pool["requests_waiting"] == 0
        assert result["silent_streams"] == {"queued": 0, "mid_stream": 0}
        assert "UNKNOWN" not in statuses and "INTERNAL" not in statuses, result["unknown_or_internal"]
        assert pool["replica_failures"] == 0 and pool["requests_failed"] == 0
        # Every way of ending a stream happened, and the server saw them all through.
        by = result["by_behaviour"]
        assert by["complete"].get("OK", 0) > 50, by
        assert by["cancel"].get("CANCEL", 0) > 0 and by["drop"].get("DROP", 0) > 0, by
        assert by["deadline"].get("DEADLINE_EXCEEDED", 0) > 0, by
        assert set(statuses) <= {"OK", "CANCEL", "DROP", "DEADLINE_EXCEEDED"}, statuses
        assert by["complete"] == {"OK": by["complete"]["OK"]}, "a request meant to complete did not"
    finally:
        assert server.stop() == 0
