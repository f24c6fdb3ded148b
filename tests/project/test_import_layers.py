"""The package's layers: every import points down (or stays in its layer), no two packages
import each other (directly or round a ring), and the layers below the model load neither
torch nor any heavy optional dependency.

The table is the layer diagram of docs/architecture.md, lowest first."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "forklift"

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "plain data",
        (
            "forklift.version",
            "forklift.cpu",
            "forklift.config",
            "forklift.speculative_config",
            "forklift.sampling_params",
            "forklift.outputs",
            "forklift.structured.params",
            "forklift.checkpoint",
            "forklift.lora_request",
        ),
    ),
    ("text", ("forklift.tokenizer", "forklift.structured")),
    ("core", ("forklift.core", "forklift.spec_decode")),
    # The kernels' ctypes wrappers know tensors, not the model's classes.
    ("kernels", ("forklift.native",)),
    ("model", ("forklift.model",)),
    ("sampling", ("forklift.sampling",)),
    ("runner", ("forklift.runner",)),
    # Drafters that run a model drive a model runner of their own.
    ("model drafters", ("forklift.model_drafters",)),
    ("engine", ("forklift.engine",)),
    ("library", ("forklift.llm", "forklift.chat_session", "forklift.hf_reference")),
    ("rl", ("forklift.rl",)),
    ("server", ("forklift.server",)),
    ("data parallel", ("forklift.dp",)),
    ("bench", ("forklift.bench",)),
    ("command line", ("forklift.cli", "forklift.__main__", "forklift")),
)

# Layers whose modules must import without torch (nor the other heavy libraries).
TORCH_FREE_LAYERS = ("plain data", "text", "core")


@dataclass(frozen=True)
class ImportEdge:
    importer: str
    imported: str
    line: int


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE_ROOT.rglob("*.py"))}


def layer_of(module: str) -> int:
    """The rank of the longest layer prefix naming `module`."""
    best, best_len = -1, -1
    for rank, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = rank, len(prefix)
    assert best >= 0, f"{module} is in no layer: add it to LAYERS"
    return best


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[ImportEdge]:
    """Every forklift import in the file, wherever it is (functions and TYPE_CHECKING too)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    edges = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            # `from pkg import sub` imports the submodule when there is one.
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                for alias in node.names
            ]
        edges += [
            ImportEdge(module, t, node.lineno)
            for t in targets
            if t == "forklift" or t.startswith("forklift.")
        ]
    return edges


def test_every_module_belongs_to_a_layer():
    for module in all_modules():
        layer_of(module)


def test_no_module_imports_from_a_layer_above_it():
    modules = all_modules()
    upward = [
        f"{e.importer}:{e.line} ({LAYERS[layer_of(e.importer)][0]}) imports {e.imported} "
        f"({LAYERS[layer_of(e.imported)][0]})"
        for module, path in modules.items()
        for e in imports_of(module, path, modules)
        if layer_of(e.imported) > layer_of(e.importer)
    ]
    assert upward == []


def test_the_walker_sees_an_upward_import(tmp_path):
    """The check above can fail: a core module importing the engine is caught."""
    path = tmp_path / "forklift" / "core" / "leaky.py"
    path.parent.mkdir(parents=True)
    path.write_text("def f():\n    from forklift.engine.engine import LLMEngine\n")
    (edge,) = imports_of("forklift.core.leaky", path, {})
    assert layer_of(edge.imported) > layer_of(edge.importer)


def package_of(module: str) -> str:
    """A module's node in the package graph: the subpackage or top-level module of forklift
    holding it (the root package is a node of its own)."""
    return ".".join(module.split(".")[:2])


def package_graph(edges: Iterable[ImportEdge]) -> dict[str, dict[str, list[ImportEdge]]]:
    """Importing package -> imported package -> the imports making that edge (imports
    within a package make none)."""
    graph: dict[str, dict[str, list[ImportEdge]]] = {}
    for edge in edges:
        source, target = package_of(edge.importer), package_of(edge.imported)
        if source != target:
            graph.setdefault(source, {}).setdefault(target, []).append(edge)
    return graph


def reachable(graph: Mapping[str, Iterable[str]], start: str) -> set[str]:
    """The packages `start` imports, directly or through others (itself only round a ring)."""
    seen: set[str] = set()
    stack = [start]
    while stack:
        for target in graph.get(stack.pop(), ()):
            if target not in seen:
                seen.add(target)
                stack.append(target)
    return seen


def import_cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Each set of packages that reach one another through imports (a strongly connected
    component of more than one package), sorted."""
    reach = {node: reachable(graph, node) for node in graph}
    rings = {
        tuple(sorted(other for other in reach[node] if node in reach.get(other, ())))
        for node in reach
        if node in reach[node]
    }
    return sorted(list(ring) for ring in rings)


def test_no_packages_import_each_other():
    modules = all_modules()
    graph = package_graph(e for m, path in modules.items() for e in imports_of(m, path, modules))
    rings = [
        [
            f"{edges[0].importer}:{edges[0].line} imports {edges[0].imported}"
            for source in ring
            for target, edges in sorted(graph[source].items())
            if target in ring
        ]
        for ring in import_cycles(graph)
    ]
    assert rings == []


def test_the_cycle_check_sees_a_ring():
    """The check above can fail: the ring the speculative config once closed (config ->
    spec_decode -> runner -> config) is caught; the engine importing into it is no part of it."""
    edges = [
        ImportEdge("forklift.config", "forklift.spec_decode.config", 10),
        ImportEdge("forklift.spec_decode.draft_model", "forklift.runner.model_runner", 31),
        ImportEdge("forklift.runner.tp_workers", "forklift.config", 24),
        ImportEdge("forklift.engine.engine", "forklift.config", 1),
        ImportEdge("forklift.engine.engine", "forklift.engine.detokenizer", 2),
    ]
    assert import_cycles(package_graph(edges)) == [
        ["forklift.config", "forklift.runner", "forklift.spec_decode"]
    ]


def torch_free_modules() -> list[str]:
    free = {LAYERS[i][0]: i for i in range(len(LAYERS))}
    ranks = {free[name] for name in TORCH_FREE_LAYERS}
    return [m for m in all_modules() if m != "forklift" and layer_of(m) in ranks]


@pytest.mark.parametrize("heavy", ["torch", "transformers", "matplotlib"])
def test_the_layers_below_the_model_import_no_heavy_library(heavy):
    modules = torch_free_modules()
    assert "forklift.core.scheduler" in modules and "forklift.tokenizer" in modules
    script = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        f"print({heavy!r} in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


def test_serving_and_the_library_load_no_plotting_or_hf_stack():
    script = (
        "import sys\n"
        "import forklift.server.app, forklift.server.run_server, forklift.llm, forklift.dp.launch\n"
        "print(sorted(m for m in ('matplotlib', 'transformers') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"
