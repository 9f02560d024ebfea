"""Generates the gRPC code from shardline/protos/*.proto whenever the package is built or installed
(editable installs included), so generated files are never edited or committed by hand."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.develop import develop

ROOT = Path(__file__).parent


def generate_protos() -> None:
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    for proto in sorted((ROOT / "shardline" / "protos").glob("*.proto")):
        args = [
            "protoc",
            f"-I{ROOT}",
            f"-I{include}",
            f"--python_out={ROOT}",
            f"--pyi_out={ROOT}",
            f"--grpc_python_out={ROOT}",
            str(proto.relative_to(ROOT)),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto}")


class BuildPy(build_py):
    def run(self):
        generate_protos()
        super().run()


class Develop(develop):
    def run(self):
        generate_protos()
        super().run()


setup(cmdclass={"build_py": BuildPy, "develop": Develop})
