"""What serving a model takes, known before its weights are read (shard/footprint.py): a model
Shardline does not serve, or one larger than the machine, is refused at start with status 2 and
a message, once; the weights a shard is estimated to hold are what it holds."""

import json
import shutil
import subprocess
import sys
import time
from argparse import Namespace

import psutil
import pytest

from shardline.common.model_source import resolve_model
from shardline.protos import generation_pb2 as pb
from shardline.shard.footprint import (
    REFUSED,
    Unservable,
    available_bytes,
    check_layout,
    describe,
    shard_footprint,
)
from tests.support import ROOT, free_port


def _serve(*args: str) -> subprocess.CompletedProcess:
    port = str(free_port())
    return subprocess.run(
        [sys.executable, "-m", "shardline.cli", "serve", "--port", port, "--http-port", "0", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def unknown_folder(tiny_models, tmp_path):
    """A checkpoint of an architecture Shardline has no model code for, as far as its config says
    (the check reads nothing else)."""
    folder = tmp_path / "OLMoE-tiny"
    shutil.copytree(tiny_models["qwen3"], folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="olmoe", num_experts=8, num_experts_per_tok=2)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _shard(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shardline.cli", "shard", *args, "--listen", "unix:/tmp/x"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.processes
def test_an_unknown_architecture_is_refused_once_with_status_2_by_serve_and_by_a_shard(unknown_folder):
    t0 = time.monotonic()
    done = _serve("--model", str(unknown_folder))
    assert done.returncode == REFUSED, done.stderr
    assert "the architecture 'olmoe' is not served" in done.stderr
    assert "restart" not in done.stderr and time.monotonic() - t0 < 30  # refused, not retried
    shard = _shard("--model", str(unknown_folder))
    assert shard.returncode == REFUSED and "'olmoe' is not served" in shard.stderr, shard.stderr


@pytest.mark.processes
def test_a_config_its_checkpoint_does_not_match_is_refused_not_restarted(tiny_models, tmp_path):
    """A mixture's config over a dense model's tensors: the missing tensors named, status 2."""
    folder = tmp_path / "Qwen3-MoE-no-experts"
    shutil.copytree(tiny_models["qwen3"], folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    (folder / "config.json").write_text(json.dumps(config))
    shard = _shard("--model", str(folder), "--weights", "dequantized")
    assert shard.returncode == REFUSED, shard.stderr
    assert "the checkpoint has no model.layers.0.mlp.gate.weight" in shard.stderr


@pytest.mark.processes
def test_a_kv_pool_larger_than_memory_is_refused_with_the_numbers_and_a_flag_that_fits(tiny_models):
    too_big = 2 * psutil.virtual_memory().total / 2**30
    done = _serve("--model", str(tiny_models["llama"]), "--kv-memory-gb", f"{too_big:.0f}")
    assert done.returncode == REFUSED, done.stderr
    assert "of KV pool" in done.stderr and "available" in done.stderr and "try --kv-memory-gb" in done.stderr


def _footprint(source, **flags):
    description = describe(source)
    layout = dict(tp=1, pp=1, tp_rank=0, pp_stage=0)
    defaults = dict(
        dtype="float32", weights="native", quantize="none", dense_copy=False, kv_memory_gb=1.0, max_batch=32
    )
    return shard_footprint(description.cfg, description.tensors, **{**layout, **defaults, **flags})


@pytest.mark.smollm2
@pytest.mark.processes
def test_the_weights_a_shard_is_estimated_to_hold_are_what_it_holds(smollm2_server):
    """SmolLM2 dequantized, as the session's server holds it (every tensor dense in fp32; the
    tied LM head is the embedding)."""
    info = smollm2_server.stub.Info(pb.InfoRequest())
    assert _footprint(resolve_model(None), weights="dequantized").weights == info.shard_weight_bytes


@pytest.mark.parametrize("quantize", ["int4", "int8"])
def test_quantized_weights_are_estimated_to_within_the_width_of_the_int8_dense_copies(
    tiny_models, quantize, own_machine_choices, monkeypatch, tmp_path
):
    """A tiny model quantized at load: int4 records, an int8 LM head (and every layer in int8)
    with a dense copy, bf16 or fp32 as measured on this machine; loaded here, no server."""
    from shardline.cli import build_parser
    from shardline.shard.load import load_shard

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # load_shard sets it
    model = str(tiny_models["llama"])
    args = build_parser().parse_args(["shard", "--model", model, "--quantize", quantize, "--listen", "unix:/x"])
    held = load_shard(args).info.weight_bytes
    tensors = describe(resolve_model(model)).tensors
    estimated = _footprint(resolve_model(model), quantize=quantize).weights
    int8_params = sum(t.params for t in tensors if quantize == "int8" and t.name.startswith("blk")) + sum(
        t.params for t in tensors if t.name == "output.weight"
    )
    assert estimated <= held <= estimated + 2 * int8_params, (estimated, held)


def test_layers_split_over_stages_and_ranks_and_the_head_sits_with_the_sampler(tiny_models):
    source = resolve_model(str(tiny_models["llama"]))
    whole = _footprint(source, weights="dequantized").weights
    stages = [_footprint(source, weights="dequantized", pp=2, pp_stage=s).weights for s in (0, 1)]
    assert sum(stages) == whole  # each tensor on exactly one stage
    ranks = [_footprint(source, weights="dequantized", tp=2, tp_rank=r) for r in (0, 1)]
    assert ranks[0].weights > ranks[1].weights and ranks[0].buffers > ranks[1].buffers  # the sampler's head


def test_available_memory_is_a_containers_limit_where_it_has_one(tmp_path):
    (tmp_path / "memory.max").write_text("1000000\n")
    (tmp_path / "memory.current").write_text("400000\n")
    assert available_bytes(tmp_path) == 600000
    (tmp_path / "memory.max").write_text("max\n")  # no limit: what the machine has
    assert available_bytes(tmp_path) > 10**8


def test_shards_on_one_host_load_at_once(tiny_models):
    """Two ranks' peaks together: a budget one shard fits in and two do not is refused."""
    source = resolve_model(str(tiny_models["llama"]))
    args = Namespace(
        tp=2,
        pp=1,
        device="",
        dtype="float32",
        weights="native",
        quantize="none",
        dense_prefill="off",
        kv_memory_gb=0.6 * available_bytes() / 2**30,
        max_batch=8,
    )
    check_layout(source, args, [(0, 0)])
    with pytest.raises(Unservable, match="2 shard"):
        check_layout(source, args, [(0, 0), (0, 1)])


def test_the_estimate_reads_slices_as_the_loader_does():
    from shardline.kernels import grid, quantized
    from shardline.shard import footprint

    assert footprint.WEIGHTS_AT_ONCE == grid.WEIGHTS_AT_ONCE
    assert footprint.MEASURING_BYTES == 2 * quantized.COLD_BYTES
