"""Every numeric flag is range-checked before anything starts, and the router refuses shards
that serve something else than it expects."""

import argparse
import asyncio
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from shardline.cli import build_parser, main
from shardline.flags import SERVICES, service_flags
from shardline.launcher import router_command, shard_command
from shardline.processes import spawn_service
from shardline.protos import shard_pb2
from tests.support import ROOT, free_port, wait_for

OUT_OF_RANGE = [
    ("serve", "--page-size", "0"),
    ("serve", "--tp", "0"),
    ("serve", "--pp", "-1"),
    ("serve", "--kv-memory-gb", "0"),
    ("serve", "--kv-memory-gb", "nan"),
    ("serve", "--threads", "-2"),
    ("serve", "--port", "70000"),
    ("serve", "--num-pages", "-1"),
    ("serve", "--max-batch", "0"),
    ("serve", "--max-batch-tokens", "0"),
    ("serve", "--chunk-size", "-1"),
    ("serve", "--priority-aging-s", "0"),
    ("serve", "--priority-aging-s", "inf"),
    ("serve", "--max-waiting", "0"),
    ("serve", "--shard-timeout", "-1"),
    ("serve", "--step-timeout-s", "0"),
    ("serve", "--drain-timeout-s", "-1"),
    ("serve", "--shard-restarts", "-1"),
    ("serve", "--slru-protected-ratio", "1.5"),
    ("serve", "--max-batch", "many"),
    ("router", "--max-batch", "0"),
    ("shard", "--tp-rank", "-1"),
    ("shard", "--pp-stage", "-1"),
    ("health", "--timeout", "0"),
    ("generate", "--max-new-tokens", "0"),
    ("generate", "--top-p", "0"),
]


@pytest.mark.parametrize("command,flag,value", OUT_OF_RANGE, ids=[f"{c} {f} {v}" for c, f, v in OUT_OF_RANGE])
def test_out_of_range_flags_exit_2_naming_the_flag(capsys, command, flag, value):
    argv = [command, flag, value] + (["hi"] if command == "generate" else [])
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)  # not main(): were the check missing, it would start serving
    assert exit_.value.code == 2
    assert flag in capsys.readouterr().err


@pytest.mark.processes
def test_environment_values_are_checked_too():
    done = subprocess.run(
        [sys.executable, "-m", "shardline.cli", "serve"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"SHARDLINE_MAX_BATCH": "0", "PATH": "/usr/bin"},
        timeout=60,
    )
    assert done.returncode == 2 and "--max-batch" in done.stderr and "[1, 4096]" in done.stderr


def test_a_shard_rank_outside_its_layout_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["shard", "--tp", "2", "--tp-rank", "2", "--dist-init", "tcp://127.0.0.1:1"])
    assert exit_.value.code == 2 and "--tp-rank 2" in capsys.readouterr().err


def _not_default(action: argparse.Action) -> str:
    """A value the flag accepts that is not its default."""
    if action.choices:
        return next(c for c in action.choices if c != action.default)
    if isinstance(action.default, (int, float)):
        return str(action.default + (1 if isinstance(action.default, int) else 0.25))
    return f"/somewhere/{action.dest}"


@pytest.mark.parametrize("service", ["router", "shard"])
def test_every_flag_serve_shares_with_a_service_reaches_it(service):
    """`serve` passes each of its flags that the router or a shard also has on to them, derived
    from the command line's definitions: set to something other than its default, every such flag
    arrives with that value, so a flag added to a service's group cannot be dropped on the way."""
    serve = argparse.ArgumentParser(add_help=False)
    for add in SERVICES["serve"]:
        add(serve)
    shared = [a for a in serve._actions if a.option_strings[0][2:] in service_flags(service)]
    argv = [part for a in shared for part in (a.option_strings[0], _not_default(a))]
    args = build_parser().parse_args(["serve", *argv])
    command = (
        shard_command(args, "unix:/tmp/s.sock", stage=0, rank=0, dist_port=29500)
        if service == "shard"
        else router_command(args, ["unix:/tmp/s.sock"])
    )
    got = build_parser().parse_args(command)
    for a in shared:
        assert getattr(got, a.dest) == getattr(args, a.dest) != a.default, a.option_strings[0]
    assert len(shared) >= (15 if service == "shard" else 23)  # the model, parallel and own groups


# -- the router checks what its shards serve --------------------------------------------------------
class StaticInfo:
    def __init__(self, info):
        self._info = info

    async def info(self, timeout):
        return self._info


class FakeShards:
    """Stands in for ShardGroup in a unit test of Replica's checks: Info answers are `infos`, put
    through the real ShardGroup's checks across shards."""

    def __init__(self, infos):
        self.infos, self.sampler, self.warmed = infos, 0, False

    async def info(self, timeout):
        from shardline.router.shards.group import ShardGroup
        from shardline.router.shards.link import ShardLink

        group = ShardGroup([])
        group.shards = [StaticInfo(i) for i in self.infos]
        infos = await ShardLink(group).info(timeout)
        self.sampler = group.sampler
        return infos

    async def warmup(self, num_pages, max_batch, window_pages=0):
        self.warmed = True


def _info(**overrides):
    base = dict(
        model="tiny",
        vocab_size=49152,
        context_length=2048,
        page_size=16,
        max_pages=100,
        tp_rank=0,
        tp_size=1,
        pp_stage=0,
        pp_size=1,
        dtype="float32",
        device="cpu",
    )
    return shard_pb2.ShardInfo(**{**base, **overrides})


def _config(**overrides):
    from tests.support import replica_config

    return replica_config(**{**dict(max_batch=8, max_batch_tokens=512, shard_timeout_s=1), **overrides})


@pytest.mark.parametrize(
    "infos,args,phrase",
    [
        ([_info(page_size=32)], {}, "page size 32 (the router's is 16)"),
        ([_info(dtype="bfloat16")], {}, "dtype 'bfloat16'"),
        ([_info(model="other")], {}, "model 'other' (the router's is 'tiny')"),
        ([_info(vocab_size=1000)], {}, "vocabulary of 1000 tokens"),
        ([_info(tp_size=2), _info(tp_size=2, tp_rank=1, page_size=32)], {}, "disagree on page_size"),
        ([_info(tp_size=2), _info(tp_size=2, tp_rank=1, model="other")], {}, "disagree on model"),
        ([_info(tp_size=2), _info(tp_size=2, tp_rank=1, kv_dtype="float16")], {}, "disagree on kv_dtype"),
        ([_info(tp_size=2), _info(tp_size=2)], {}, "do not form one TP2 x PP1 replica"),
        ([_info()], {"page_size": 8}, "page size 16 (the router's is 8)"),
    ],
    ids=[
        "page size",
        "dtype",
        "model",
        "vocabulary",
        "shards' page sizes",
        "shards' models",
        "shards' KV dtypes",
        "layout",
        "router's page size",
    ],
)
def test_the_router_refuses_shards_that_serve_something_else(infos, args, phrase):
    from shardline.router.core.replica import Replica
    from shardline.router.core.shards import ShardError
    from tests.support import smollm2_codec

    async def scenario():
        shards = FakeShards(infos)
        replica = Replica(_config(**args), "tiny", shards, smollm2_codec(), on_serving=None)
        with pytest.raises(ShardError) as err:
            await replica._connect()
        assert phrase in str(err.value)
        assert not shards.warmed

    asyncio.run(scenario())


@pytest.mark.processes
def test_a_router_with_another_page_size_does_not_take_a_shard(tiny_models):
    """The same check against real processes: the router stays unconnected and says why."""
    logs = Path(tempfile.mkdtemp())
    model = str(tiny_models["llama"])
    shard = spawn_service(
        ["shard", "--model", model, "--page-size", "16", "--listen", f"unix:{logs}/s.sock"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    log = open(logs / "router.log", "w")
    router = spawn_service(
        [
            "router",
            "--model",
            model,
            "--page-size",
            "32",
            "--port",
            str(free_port()),
            "--http-port",
            "0",
            "--shards",
            f"unix:{logs}/s.sock",
        ],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for(
            lambda: "page size 16 (the router's is 32)" in (logs / "router.log").read_text(),
            60,
            "the router to refuse the shard",
        )
        assert router.poll() is None  # it keeps trying, in case the right shard comes
    finally:
        for proc in (router, shard):
            proc.kill()
            proc.wait()
