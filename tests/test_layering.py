"""The layering DESIGN.md states, read off the code: every import (at module level or inside a
function) of every part runs one way, no two modules import each other (directly or through
others), and the router process imports no torch."""
import ast
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


def part_of(module: str) -> str:
    """`shardline.router.engine` -> router, `shardline.cli` -> shardline, `tests.support` -> tests."""
    top, _, rest = module.partition(".")
    sub = rest.partition(".")[0]
    return sub if top == "shardline" and sub in PARTS else top


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
            out.update(f"{node.module}.{alias.name}" for alias in node.names
                       if f"{node.module}.{alias.name}" in MODULES)
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
            cycles.append(" -> ".join(path[path.index(module):] + [module]))
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
