import multiprocessing.process
import subprocess

import pytest
from xdist import is_xdist_controller

from tests.support import Server, make_tiny_model


def _refuse_processes(set_attr, who: str) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError(f"{who} starts a process: mark its test @pytest.mark.processes")

    set_attr(subprocess.Popen, "__init__", refuse)
    set_attr(multiprocessing.process.BaseProcess, "start", refuse)


def pytest_configure(config):
    """What tests of either kind read is made first, once: Shardline's CPU kernels (loading them
    asks the compiler whether the build is current) and the default model's tokenizer files (a
    child process converts them from the GGUF where the cache holds none yet)."""
    from shardline.common.model_source import resolve_model
    from shardline.common.tokenizer_files import tokenizer_folder
    from shardline.kernels import native

    native.available()
    tokenizer_folder(resolve_model(None))


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session):
    """`-m "not processes"` runs the in-process tests alone: then nothing may start a process,
    fixtures of any scope included. Under pytest-xdist (./test.sh) that holds in the workers, once
    they have started: their controller starts them."""
    if "not processes" in (session.config.option.markexpr or "") and not is_xdist_controller(session):
        _refuse_processes(setattr, "this in-process run")


@pytest.fixture(autouse=True)
def _in_process_unless_marked(request, monkeypatch):
    """A test that starts a process (a server, a shard group, torch.distributed workers, a build,
    a tool) is marked `processes`; this keeps the mark honest in every run: an unmarked test that
    starts one fails. (A fixture of wider scope is set up before this one: the in-process run
    above catches those.)"""
    if request.node.get_closest_marker("processes") is None:
        _refuse_processes(monkeypatch.setattr, request.node.nodeid)


@pytest.fixture
def own_machine_choices(tmp_path, monkeypatch):
    """Per-machine kernel choices (kernels/choice.py) kept in a folder of this test's own, so a
    unit test that builds quantized layers neither reads nor writes the machine's (the kernels
    stay built where they are)."""
    from shardline.kernels import choice, native

    native.available()
    monkeypatch.setattr(choice.native, "build_folder", lambda: tmp_path)
    return tmp_path


class _TinyModels(dict):
    """arch -> folder of a random Hugging Face checkpoint, made on first use."""

    def __init__(self, root):
        super().__init__()
        self.root = root

    def __missing__(self, arch):
        self[arch] = make_tiny_model(arch, self.root / arch)
        return self[arch]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """arch -> folder of a random Hugging Face checkpoint, made once per test session."""
    return _TinyModels(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def smollm2_server():
    server = Server("--max-batch", "16", "--weights", "dequantized")
    yield server
    assert server.stop() == 0, "".join(server.log[-30:])
