"""A GGUF's load peaks near what is served (shard/gguf_loader.py, shard/served_cache.py), measured
in a shard's own process: its resident memory's high-water mark over what it held before loading,
on a first start (read and repacked, and kept by a thread meanwhile) and a second (mapped from
what was kept)."""

import json
import shutil
import subprocess
import sys

import pytest

from shardline.common.model_source import resolve_model
from shardline.shard.footprint import describe
from tests.support import ROOT
from tests.test_footprint import _footprint
from tests.test_gguf_loader import write_gguf

# hidden, intermediate, layers, heads, KV heads, vocabulary: 66M weights, 266 MB in fp32
SHAPE = (1024, 4096, 4, 16, 4, 8192)

LOAD = """
import json, sys
from pathlib import Path

def status():
    lines = Path("/proc/self/status").read_text().splitlines()
    return {l.split(":")[0]: int(l.split()[1]) * 1024 for l in lines if l.startswith(("VmHWM", "VmRSS"))}

from shardline.cli import build_parser
from shardline.kernels import native
from shardline.shard.load import load_shard

native.available()
before = status()["VmRSS"]
shard = load_shard(build_parser().parse_args(["shard", "--listen", "unix:/unused", "--model", sys.argv[1]]))
if shard.keep is not None:  # as the shard does once warm: what a second start maps
    shard.keep.start()
    shard.keep.join()
print(json.dumps({"before": before, "peak": status()["VmHWM"], "weights": shard.info.weight_bytes}))
"""


def _load(path) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", LOAD, str(path)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.processes
def test_a_gguf_loads_without_a_dense_copy_of_the_model(tmp_path):
    path = write_gguf(  # Q4_K_M's mix: Q4_K, the FFN down projection Q6_K, a tied Q8_0 embedding
        tmp_path / "model.gguf",
        tied=True,
        embed="Q8_0",
        shape=SHAPE,
        types=lambda layer, part: "Q6_K" if part == "ffn_down" else "Q4_K",
    )
    source = resolve_model(str(path))
    try:
        first, second = _load(path), _load(path)
        estimate = _footprint(source, kv_memory_gb=0, streamed=True)
        fp32 = 4 * sum(t.params for t in describe(source).tensors)
    finally:
        shutil.rmtree(source.cache_dir, ignore_errors=True)
    assert first["weights"] == second["weights"] == estimate.weights
    for start in (first, second):
        grew = start["peak"] - start["before"]
        # what the launcher checks a host's memory against is an upper bound
        assert grew <= estimate.loading, (grew, estimate.loading)
        # the served weights, the largest layer as it is made (and timed, where its shape is new
        # to the machine), and slices of a tensor: the fp32 detour this replaced held the model
        # twice over (8 bytes a weight, 530 MB here)
        assert grew < 1.5 * start["weights"] + (160 << 20), (grew, start["weights"], fp32)
    # a second start maps what the first kept: the weights and little else
    assert second["peak"] - second["before"] < 1.25 * second["weights"] + (16 << 20), (second, first)
