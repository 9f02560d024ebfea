"""The layering DESIGN.md states, read off the code: every import (at module level or inside a
function) of every part runs one way, the router's rooms too, and its core imports no server
code, no gRPC and no wire message; no two modules import each other (directly or through others); the
router process imports no torch; and the wheel installs one top-level package."""

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support import ROOT

# The product's parts, each a package under `shardline`; its own modules (the command, the
# launcher) are the composition on top, the part named "shardline".
PARTS = ("protos", "common", "kernels", "shard", "router", "gateway")
PRODUCT = (*PARTS, "shardline")
# part -> the parts it may import (DESIGN.md, "Layers")
MAY_IMPORT = {
    "protos": set(),
    "common": {"protos"},
    "kernels": {"common"},
    "shard": {"common", "protos", "kernels"},
    "router": {"common", "protos"},
    "gateway": {"common", "protos"},
    "shardline": {"common", "protos", "router", "shard", "gateway"},
    "harness": {*PRODUCT},
    "tests": {*PRODUCT, "harness"},
    "bench": {*PRODUCT, "harness"},
}
TORCH = ("torch", "transformers", "safetensors", "gguf", "numpy")  # what the router process never loads

# The router's rooms (shardline/router/__init__.py) -> the rooms they may import; `router` is the
# process that composes them (app.py).
ROOMS = ("core", "shards", "requests", "api", "observers")
ROOM_MAY_IMPORT = {
    "router.core": set(),
    "router.shards": {"router.core"},
    "router.requests": {"router.core"},
    "router.observers": {"router.core"},
    "router.api": {"router.core", "router.requests", "router.observers"},
    "router": {f"router.{room}" for room in ROOMS},
}
# What the engine core never imports: server code, HTTP frameworks, gRPC, any wire message (the
# shard contract's included: router/shards/codec.py translates it).
NOT_IN_CORE = (
    "grpc",
    "grpc_health",
    "google.protobuf",
    "shardline.protos",
    "fastapi",
    "starlette",
    "uvicorn",
    "pydantic",
    "grpc_reflection",
    "shardline.common.generation_service",
    "shardline.common.http_server",
)


def part_of(module: str) -> str:
    """`shardline.router.core.engine` -> router, `shardline.cli` -> shardline, `tests.support` -> tests."""
    top, _, rest = module.partition(".")
    sub = rest.partition(".")[0]
    return sub if top == "shardline" and sub in PARTS else top


def room_of(module: str) -> str | None:
    """`shardline.router.core.engine` -> router.core, `shardline.router.app` -> router; None
    outside the router."""
    parts = module.split(".")
    if parts[:2] != ["shardline", "router"]:
        return None
    return f"router.{parts[2]}" if len(parts) > 2 and parts[2] in ROOMS else "router"


def _modules() -> dict[str, Path]:
    found = {}
    for folder in ("shardline", "harness", "tests", "bench"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "_pb2" in path.name:  # generated
                continue
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


MODULES = _modules()


def _imports(path: Path, when_loaded: bool = False) -> set[str]:
    """Every module `path` imports, by its full name (`from kernels import native` names
    kernels.native when that is a module); `when_loaded`: only those that loading it imports
    (not those inside its functions)."""
    out = set()

    def visit(node):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
            out.update(
                f"{node.module}.{alias.name}" for alias in node.names if f"{node.module}.{alias.name}" in MODULES
            )
        if not (when_loaded and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))):
            for child in ast.iter_child_nodes(node):
                visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return out


GRAPH = {name: _imports(path) for name, path in MODULES.items()}


def _project(names) -> set[str]:
    return {n for n in names if n in MODULES}


def test_every_import_runs_one_way():
    wrong = []
    for module, imported in GRAPH.items():
        part = part_of(module)
        for other in _project(imported):
            theirs = part_of(other)
            if theirs != part and theirs not in MAY_IMPORT[part]:
                wrong.append(f"{module} imports {other}")
    assert not wrong, "\n".join(wrong)


def test_no_two_modules_import_each_other():
    """Not directly, and not through others: the module graph has no cycle."""
    done, path, cycles = set(), [], []

    def visit(module):
        if module in path:
            cycles.append(" -> ".join(path[path.index(module) :] + [module]))
            return
        if module in done:
            return
        path.append(module)
        for other in sorted(_project(GRAPH[module])):
            if other != module.rpartition(".")[0]:  # a package's __init__ is not an import of its own
                visit(other)
        path.pop()
        done.add(module)

    for module in sorted(GRAPH):
        visit(module)
    assert not cycles, "\n".join(cycles)


@pytest.mark.parametrize("app", ["shardline.router.app", "shardline.gateway.app"])
def test_the_router_and_gateway_processes_import_no_torch(app):
    """Nothing the router (or gateway) process imports imports torch (or what maps it): what
    loading the command line imports, and whatever its app imports through any chain of project
    modules. tests/test_launcher.py checks the running router's memory maps as well."""
    cli = _imports(MODULES["shardline.cli"], when_loaded=True)
    seen, todo, heavy = set(), [app, *_project(cli)], [m for m in cli if m.split(".")[0] in TORCH]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        imported = _imports(MODULES[module], when_loaded=True) if part_of(module) == "shardline" else GRAPH[module]
        heavy += [f"{module} imports {m}" for m in imported if m.split(".")[0] in TORCH]
        todo += _project(imported)
    assert not heavy, "\n".join(heavy)
    assert len(seen) > 5  # the walk did reach the modules behind the entry point


def test_the_routers_rooms_import_one_way():
    wrong = []
    for module, imported in GRAPH.items():
        room = room_of(module)
        for other in _project(imported) if room else ():
            theirs = room_of(other)
            if theirs and theirs != room and theirs not in ROOM_MAY_IMPORT[room]:
                wrong.append(f"{module} imports {other}")
    assert not wrong, "\n".join(wrong)


def _names(path: Path) -> set[str]:
    """Every dotted name `path` imports: modules, and what is imported from them (generated
    modules such as `generation_pb2` are not in MODULES)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.update({node.module, *(f"{node.module}.{alias.name}" for alias in node.names)})
    return out


def test_the_router_core_imports_no_server_code_and_no_wire_types():
    core = [m for m in GRAPH if room_of(m) == "router.core"]
    assert len(core) > 8  # the walk found the core
    wrong = [
        f"{module} imports {name}"
        for module in core
        for name in _names(MODULES[module])
        if any(name == banned or name.startswith(banned + ".") for banned in NOT_IN_CORE)
    ]
    assert not wrong, "\n".join(wrong)


@pytest.mark.processes
def test_the_wheel_installs_one_top_level_package(tmp_path):
    """Built from what the repository tracks, as a user's `pip install` builds it."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    source = tmp_path / "source"
    for name in tracked.splitlines():
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert tops == {"shardline"}
    # what a served model needs beside the Python: the generated contracts and the kernels' source
    assert {"shardline/protos/shard_pb2.py", "shardline/kernels/native.cpp"} <= set(names)
