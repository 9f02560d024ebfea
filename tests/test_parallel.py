"""Tensor and pipeline parallel replicas: real shard processes joined by torch.distributed (gloo)."""
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import generation_pb2 as pb, generation_pb2_grpc as pb_grpc
from router.launcher import die_with_parent
from tests.support import (ROOT, Server, assert_greedy_match, assert_serves_like_reference, free_ports,
                           hf_greedy, hf_model, smollm2_hf_model, smollm2_tokenizer)

PAGE = 16


@pytest.mark.parametrize("arch,tp,pp,chunk,cache", [
    ("qwen3", 2, 1, 7, "on"),     # one KV head, two ranks: the KV head is replicated
    ("llama", 1, 2, 0, "off"),
    ("qwen2", 2, 2, 64, "on"),
])
def test_tiny_parallel_layouts_match_transformers(tiny_models, arch, tp, pp, chunk, cache):
    ref = hf_model(tiny_models[arch])
    rng = random.Random(tp * 10 + pp)
    prompts = [[rng.randrange(ref.config.vocab_size) for _ in range(n)] for n in (5, 70, 300)]
    wants = [hf_greedy(ref, p, 10) for p in prompts]
    server = Server("--model", str(tiny_models[arch]), "--page-size", str(PAGE), "--tp", str(tp), "--pp", str(pp),
                    "--threads", "1", "--chunk-size", str(chunk), "--prefix-cache", cache)
    try:
        info = server.stub.Info(pb.InfoRequest())
        assert (info.tensor_parallel, info.pipeline_parallel) == (tp, pp)
        assert_serves_like_reference(server, prompts, wants, cache)
    finally:
        assert server.stop() == 0


@pytest.mark.smollm2
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_smollm2_parallel_layouts_match_transformers(tp, pp, tmp_path):
    tok = smollm2_tokenizer()
    ids = tok.encode(" ".join(f"Fact {i}: water boils at {90 + i} degrees on mountain {i}." for i in range(20)),
                     add_special_tokens=False)
    want, margins = hf_greedy(smollm2_hf_model(tmp_path), ids, 12)
    server = Server("--tp", str(tp), "--pp", str(pp), "--threads", "1", "--chunk-size", "64")
    try:
        for _ in range(2):
            got, _, last = server.generate(prompt_token_ids=pb.PromptTokens(ids=ids), max_new_tokens=12,
                                           ignore_eos=True)
            assert_greedy_match(got, want, margins)
        assert last.usage.cached_prompt_tokens > 0
    finally:
        assert server.stop() == 0


def _spawn(log: Path, *args):
    with open(log, "w") as out:  # read back when the test fails
        return subprocess.Popen([sys.executable, "-m", "router.cli", *args], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, preexec_fn=die_with_parent)


def test_a_dead_shard_fails_requests_with_unavailable_and_returns_pages(tiny_models):
    """Router and a PP2 replica as separate processes, as a compose deployment runs them."""
    model, sockets = str(tiny_models["llama"]), Path(tempfile.mkdtemp())
    dist_port, port = free_ports(2)
    common = ["--model", model, "--page-size", str(PAGE), "--pp", "2", "--threads", "1",
              "--dist-init", f"tcp://127.0.0.1:{dist_port}"]
    shards = [_spawn(sockets / f"shard{s}.log", "shard", *common, "--pp-stage", str(s),
                     "--listen", f"unix:{sockets}/s{s}.sock") for s in range(2)]
    router = _spawn(sockets / "router.log", "router", "--model", model, "--page-size", str(PAGE),
                    "--port", str(port), "--shards", f"unix:{sockets}/s0.sock,unix:{sockets}/s1.sock")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        stub = pb_grpc.GenerationStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        stream = stub.Generate(pb.GenerateRequest(prompt="hello", max_new_tokens=1500, ignore_eos=True),
                               wait_for_ready=True, timeout=120)
        next(stream)
        assert stub.Stats(pb.StatsRequest()).pages_referenced > 0
        shards[1].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            for _ in stream:
                pass
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - t0 < 10
        st = stub.Stats(pb.StatsRequest())
        assert st.pages_referenced == 0 and st.requests_running == 0
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as err:
            next(stub.Generate(pb.GenerateRequest(prompt="again", max_new_tokens=2)))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert router.poll() is None
    except BaseException:
        for log in sorted(sockets.glob("*.log")):
            print(f"--- {log.name}\n" + log.read_text()[-3000:])
        raise
    finally:
        channel.close()
        for proc in [router, *shards]:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("stage", [0, 1])
def test_kv_writes_land_only_in_scheduled_slots_on_each_stage(tiny_models, stage):
    from kernels.attention import AttentionBatch
    from shard.kv_cache import KVPages
    from shard.parallel import Layout, keep_stage
    from shard.source import resolve_model
    from shard.weights import build_model

    model = build_model(resolve_model(str(tiny_models["qwen2"])), torch.float32, torch.device("cpu"))
    keep_stage(model, Layout(pp=2, pp_stage=stage))
    kv = KVPages(model.cfg, num_pages=8, page_size=4, dtype=torch.float32, device=torch.device("cpu"))
    for k, v in kv.layers:
        k.fill_(float("nan"))
        v.fill_(float("nan"))
    table = torch.tensor([5, 2])
    positions = torch.arange(0, 6)
    slots = table[positions // 4] * 4 + positions % 4
    batch = AttentionBatch(slots=slots, is_decode=False, query_lens=[6], start_positions=[0],
                           block_tables_list=[table])
    hidden = None if stage == 0 else torch.randn(6, model.cfg.hidden_size)
    with torch.inference_mode():
        model(torch.arange(6), positions, kv.layers, batch, hidden)
    written = torch.zeros(9 * 4, dtype=torch.bool)
    written[slots] = True
    assert len(kv.layers) == len(model.layers) > 0
    for k, v in kv.layers:
        for pages in (k, v):
            flat = pages.view(-1, *pages.shape[2:])
            assert not torch.isnan(flat[written]).any()
            assert torch.isnan(flat[~written]).all()
