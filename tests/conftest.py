import pytest

from tests.support import Server, make_tiny_model


@pytest.fixture
def own_machine_choices(tmp_path, monkeypatch):
    """Per-machine kernel choices (kernels/choice.py) kept in a folder of this test's own, so a
    unit test that builds quantized layers neither reads nor writes the machine's (the kernels
    stay built where they are)."""
    from shardline.kernels import choice, native

    native.available()
    monkeypatch.setattr(choice.native, "build_folder", lambda: tmp_path)
    return tmp_path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """arch -> folder of a random Hugging Face checkpoint, made once per test session."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(arch, root / arch) for arch in ("llama", "qwen2", "qwen3")}


@pytest.fixture(scope="session")
def smollm2_server():
    server = Server("--max-batch", "16", "--weights", "dequantized")
    yield server
    assert server.stop() == 0, "".join(server.log[-30:])
