"""The package's import graph: no cycle (imports inside functions included) and one-way layers.

Layers, lowest first (a module may import its own layer and those below; docs/design.md draws the tree):
``core`` → ``ops`` → ``methods`` → transformers glue (``integration``, ``patches``, ``functional``) → ``api`` (and
the package root) → tools (``models``, ``testing``, ``tools``, ``cli``, ``eval``, ``finetune``, ``vllm``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"hf_sparse_attn": ROOT / "hf_sparse_attn", "hf_sparse_attn.eval": ROOT / "eval"}
LAYERS = [
    {"core"},
    {"ops"},
    {"methods"},
    {"integration", "patches", "functional"},
    {"api", ""},
    {"models", "testing", "tools", "cli", "eval", "finetune", "vllm"},
]


def _modules() -> dict[str, Path]:
    found = {}
    for name, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("").parts
            if "metric_modules" in rel:  # standalone `evaluate` scripts loaded by path
                continue
            parts = [*name.split("."), *rel]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path], unknown: list[str] | None = None) -> set[str]:
    """Package modules ``name`` imports anywhere in its file (``from x import y`` counts ``x.y`` when that is a
    module, else ``x``); imports of ``hf_sparse_attn.*`` modules that do not exist are added to ``unknown``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in modules and t != name)
        if unknown is not None:
            unknown += [f"{name}: {t}" for t in targets if t.startswith("hf_sparse_attn") and t not in modules]
    return out


GRAPH = {name: _imports(name, path, _modules()) for name, path in _modules().items()}


def _layer(name: str) -> int:
    rest = name.removeprefix("hf_sparse_attn").lstrip(".")
    top = rest.split(".")[0]
    for i, layer in enumerate(LAYERS):
        if top in layer:
            return i
    raise AssertionError(f"module {name} is in no layer of {LAYERS}: add its folder to tests/test_layout.py")


def _find_cycle() -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(GRAPH[node]):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(GRAPH):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_sees_the_package():
    assert len(GRAPH) > 50 and "hf_sparse_attn.ops.block_sparse.op" in GRAPH
    assert "hf_sparse_attn.ops.block_sparse.naive" in GRAPH["hf_sparse_attn.ops.block_sparse.op"]


def test_every_package_import_resolves():
    modules, unknown = _modules(), []
    for name, path in modules.items():
        _imports(name, path, modules, unknown)
    assert not unknown, f"imports of modules that do not exist: {unknown}"


def test_no_import_cycle():
    cycle = _find_cycle()
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("name", sorted(GRAPH))
def test_imports_go_down_the_layers(name):
    up = sorted(dep for dep in GRAPH[name] if _layer(dep) > _layer(name))
    assert not up, f"{name} (layer {_layer(name)}) imports higher layers: {up}"


def test_the_cycle_finder_finds_a_cycle(monkeypatch):
    monkeypatch.setitem(GRAPH, "hf_sparse_attn.core.masks", {"hf_sparse_attn.api"})
    assert _find_cycle() is not None
