"""A shard that dies, hangs or loses its stream fails only what was in flight; its group is
restarted as a whole and the same router serves correct answers again. SIGTERM drains."""

import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from shardline.processes import spawn_service
from shardline.protos import generation_pb2 as pb
from shardline.protos import generation_pb2_grpc as pb_grpc
from tests.support import (
    ROOT,
    Server,
    alive,
    assert_greedy_match,
    free_ports,
    health_status,
    hf_greedy,
    hf_model,
    wait_for,
)

pytestmark = pytest.mark.processes  # every test here starts processes

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
LONG = pb.GenerateRequest(prompt_token_ids=pb.PromptTokens(ids=[5, 6, 7]), max_new_tokens=1500, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_models):
    ref = hf_model(tiny_models["llama"])
    prompt = [random.Random(3).randrange(ref.config.vocab_size) for _ in range(40)]
    return prompt, hf_greedy(ref, prompt, 10)


def _fails_unavailable_soon(stream, since: float) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        for _ in stream:
            pass
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
    assert time.monotonic() - since < 10, f"in-flight request ended {time.monotonic() - since:.1f} s after the fault"
    return err.value


def _answers_correctly_again(server: Server, reference) -> None:
    try:
        wait_for(lambda: health_status(server.channel) == SERVING, 90, "the replica to serve again")
    except AssertionError:
        print(server.output(200))
        raise
    prompt, (want, margins) = reference
    tokens, _, _ = server.generate(prompt_token_ids=pb.PromptTokens(ids=prompt), max_new_tokens=10, ignore_eos=True)
    assert_greedy_match(tokens, want, margins)
    st = server.wait_idle()
    assert (st.replica_failures, st.replica_recoveries) == (1, 1)
    assert st.pages_referenced == 0 and st.pages_free + st.pages_evictable == st.pages_total


@pytest.mark.parametrize("tp,pp,victim", [(1, 1, 0), (2, 1, 1), (1, 2, 1)], ids=["TP1", "TP2", "PP2"])
def test_kill_9_of_a_shard_mid_stream_then_the_same_router_answers_correctly(tiny_models, reference, tp, pp, victim):
    server = Server(
        "--model", str(tiny_models["llama"]), "--page-size", "16", "--tp", str(tp), "--pp", str(pp), "--threads", "1"
    )
    try:
        router, shards = server.router_pid(), server.shard_pids()
        stream = server.stub.Generate(LONG, timeout=120)
        next(stream)
        os.kill(shards[victim], signal.SIGKILL)
        err = _fails_unavailable_soon(stream, time.monotonic())
        assert "replica failed" in err.details()
        assert health_status(server.channel) == NOT_SERVING
        _answers_correctly_again(server, reference)
        assert server.router_pid() == router, "the router must not restart"
        assert not any(alive(p) for p in shards), "the whole group is restarted"
        assert any("restarting the shard group" in line for line in server.log)
    finally:
        assert server.stop() == 0


def test_a_sigstopped_shard_is_detected_and_its_group_restarted(tiny_models, reference):
    server = Server("--model", str(tiny_models["llama"]), "--page-size", "16", "--step-timeout-s", "1")
    try:
        (shard,) = server.shard_pids()
        stream = server.stub.Generate(LONG, timeout=120)
        next(stream)
        os.kill(shard, signal.SIGSTOP)
        err = _fails_unavailable_soon(stream, time.monotonic())
        assert "did not answer a health check" in err.details()
        _answers_correctly_again(server, reference)
        assert not alive(shard)
    finally:
        assert server.stop() == 0


def test_a_step_whose_compute_hangs_while_the_shard_answers_health_fails_the_replica(tiny_models, reference):
    hang = {
        "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "faults"), os.environ.get("PYTHONPATH", "")]),
        "SHARDLINE_TEST_HANG_SEED": "777",
        "SHARDLINE_TEST_HANG_S": "6",
    }
    server = Server("--model", str(tiny_models["llama"]), "--page-size", "16", "--step-timeout-s", "1", env=hang)
    try:
        (shard,) = server.shard_pids()
        stream = server.stub.Generate(
            pb.GenerateRequest(
                prompt_token_ids=pb.PromptTokens(ids=[5, 6, 7]),
                max_new_tokens=5,
                sampling=pb.SamplingParams(temperature=1.0, seed=777),
            ),
            timeout=120,
        )
        err = _fails_unavailable_soon(stream, time.monotonic())
        assert "still answer health checks: their compute hangs" in err.details()
        _answers_correctly_again(server, reference)
    finally:
        assert server.stop() == 0


def test_the_launcher_gives_up_after_its_restart_limit(tiny_models):
    server = Server("--model", str(tiny_models["llama"]), "--page-size", "16", "--shard-restarts", "0")
    try:
        kids = server.shard_pids() + [server.router_pid()]
        os.kill(server.shard_pids()[0], signal.SIGKILL)
        assert server.proc.wait(30) == 1
        wait_for(lambda: any("giving up" in line for line in server.log), 5, "the launcher to say why")
        wait_for(lambda: not any(alive(k) for k in kids), 15, "every child to be gone")
    finally:
        server.stop()


@pytest.mark.parametrize("drain_s,completes", [(30, True), (1, False)], ids=["completes", "times-out"])
def test_sigterm_drains_in_flight_streams(tiny_models, drain_s, completes):
    server = Server("--model", str(tiny_models["llama"]), "--page-size", "16", "--drain-timeout-s", str(drain_s))
    new_tokens = 200 if completes else 1500
    req = pb.GenerateRequest(
        prompt_token_ids=pb.PromptTokens(ids=[5, 6, 7]), max_new_tokens=new_tokens, ignore_eos=True
    )
    try:
        stream = server.stub.Generate(req, timeout=120)
        tokens = list(next(stream).token_ids)
        server.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: health_status(server.channel) == NOT_SERVING, 5, "NOT_SERVING")
        with pytest.raises(grpc.RpcError) as err:
            server.generate(prompt="hello", max_new_tokens=2)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in err.value.details()
        if completes:
            for msg in stream:
                tokens += msg.token_ids
            assert len(tokens) == new_tokens and msg.finish_reason == "length"
        else:
            t0 = time.monotonic()
            err = _fails_unavailable_soon(stream, t0)
            assert "shutting down" in err.details()
        assert server.proc.wait(60) == 0
    finally:
        server.stop()


def _spawn(log: Path, *args):
    with open(log, "a") as out:  # read back when the test fails
        return spawn_service(list(args), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)


def test_separately_run_shards_restarted_by_their_supervisor_are_taken_back(tiny_models, reference):
    """Router and a PP2 replica as separate processes, as compose runs them. A stage killed while
    the replica is idle: the router notices without a step, abandons the other stage's stream,
    and that stage exits by itself (its group is broken). When both are started again (as
    compose's restart policy does), the same router serves again."""
    model, logs = str(tiny_models["llama"]), Path(tempfile.mkdtemp())
    dist_port, port = free_ports(2)
    common = [
        "--model",
        model,
        "--page-size",
        "16",
        "--pp",
        "2",
        "--threads",
        "1",
        "--dist-init",
        f"tcp://127.0.0.1:{dist_port}",
    ]

    def start_shards():
        return [
            _spawn(logs / f"shard{s}.log", "shard", *common, "--pp-stage", str(s), "--listen", f"unix:{logs}/s{s}.sock")
            for s in range(2)
        ]

    shards = start_shards()
    router = _spawn(
        logs / "router.log",
        "router",
        "--model",
        model,
        "--page-size",
        "16",
        "--port",
        str(port),
        "--http-port",
        "0",
        "--shards",
        f"unix:{logs}/s0.sock,unix:{logs}/s1.sock",
    )
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        stub = pb_grpc.GenerationStub(channel)
        list(stub.Generate(pb.GenerateRequest(prompt="hello", max_new_tokens=3), wait_for_ready=True, timeout=120))
        shards[1].send_signal(signal.SIGKILL)
        assert shards[0].wait(15) == 1, "the surviving stage must leave its broken group"
        wait_for(lambda: health_status(channel) == NOT_SERVING, 10, "the router to notice")
        with pytest.raises(grpc.RpcError) as err:
            next(stub.Generate(pb.GenerateRequest(prompt="again", max_new_tokens=2)))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "not serving" in err.value.details()
        st = stub.Stats(pb.StatsRequest())
        assert st.pages_referenced == 0 and st.requests_running == 0 and not st.serving
        shards = start_shards()
        wait_for(lambda: health_status(channel) == SERVING, 90, "the router to take the group back")
        prompt, (want, margins) = reference
        tokens = [
            t
            for m in stub.Generate(
                pb.GenerateRequest(prompt_token_ids=pb.PromptTokens(ids=prompt), max_new_tokens=10, ignore_eos=True),
                timeout=60,
            )
            for t in m.token_ids
        ]
        assert_greedy_match(tokens, want, margins)
        assert router.poll() is None
    except BaseException:
        for log in sorted(logs.glob("*.log")):
            print(f"--- {log.name}\n" + log.read_text()[-3000:])
        raise
    finally:
        channel.close()
        for proc in [router, *shards]:
            proc.kill()
            proc.wait()


WEDGE = r"""
import sys, threading, time
import shardline.shard.server as server
server.WEDGED_S = 1.0
work = server.MainThreadWork()
started = time.monotonic()
# A call longer than WEDGED_S runs to its end: the watchdog is off during calls.
threading.Thread(target=lambda: print("call", work.call(time.sleep, 1.5), flush=True), daemon=True).start()
work.serve_until(lambda: time.monotonic() - started > 2.5)
print("served", flush=True)
if sys.argv[1] == "wedge":  # then a thread that takes the GIL while the loop waits, for good
    threading.Thread(target=lambda: (time.sleep(0.5), sum(range(10 ** 13))), daemon=True).start()
    work.serve_until(lambda: False)
"""


STOPPED_BY_A_SLOW_HANDLER = r"""
import signal, time
import shardline.shard.server as server
stopped = []
signal.signal(signal.SIGALRM, lambda *_: (time.sleep(0.2), stopped.append(True)))  # longer than a wait
signal.setitimer(signal.ITIMER_REAL, 0.01)
server.MainThreadWork().serve_until(lambda: bool(stopped))
print("stopped", flush=True)
"""


def test_a_signal_handler_that_outlasts_the_loops_wait_does_not_stop_it_turning():
    """A dead launcher's SIGTERM runs the shard's handler inside the main loop's wait; one that
    ran past the wait's 50 ms left a SimpleQueue waiting for good (CPython 3.11), and the shard
    never saw its stop (test_launcher's killed launcher, once in a while)."""
    done = subprocess.run(
        [sys.executable, "-c", STOPPED_BY_A_SLOW_HANDLER], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and "stopped" in done.stdout, done.stdout + done.stderr


@pytest.mark.parametrize("case", ["wedge", "calm"])
def test_a_shard_whose_main_loop_stops_turning_exits_with_every_threads_stack(case):
    """A wedged main thread (here: another thread holds the GIL) cannot run Python, not even its
    SIGTERM handler; the loop's watchdog ends the process from outside the GIL. A long call is
    not a wedge."""
    done = subprocess.run([sys.executable, "-c", WEDGE, case], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert "call None" in done.stdout and "served" in done.stdout, done.stdout + done.stderr
    if case == "wedge":
        assert done.returncode == 1 and "Timeout" in done.stderr and "serve_until" in done.stderr, done.stderr
    else:
        assert done.returncode == 0, done.stderr
