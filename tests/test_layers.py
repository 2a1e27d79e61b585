"""The package's layers: every import points down (or within its own package), and no two modules import each other,
directly or around a loop. Imports inside functions count (a lazy import is still a dependency); imports only for
type checkers (``if TYPE_CHECKING:``) and a script's own entry block (``if __name__ == "__main__":``) do not.

    data, the package root   prompt sets, paths, plots
    runtime                  in layers of its own: core (contract, caches, trees, verification, sampling, manifest)
                             -> models (attention, target) -> drafts -> decoding (drafters, the loop) -> ort (graphs,
                             the ONNX Runtime backend) -> its top-level wiring (registry, checkpoints, loader, engine,
                             CLI, demo inputs)
    train, export, serving,  each on the runtime alone: none of them imports another
    edge, loadtest
    bench                    measures all of the above
"""

from __future__ import annotations

import ast
from pathlib import Path

from package_layout import installed_sources

LAYERS = (
    {"specdec_kit", "specdec_kit.data"},
    {"specdec_kit.runtime"},
    {"specdec_kit.train", "specdec_kit.export", "specdec_kit.serving", "specdec_kit.edge", "specdec_kit.loadtest"},
    {"specdec_kit.bench"},
)
# shipped into other engines' processes (vLLM, SGLang, TensorRT-LLM), where they import those engines, not the layers
EXCLUDED = ("specdec_kit.export.plugins",)


def modules() -> dict[str, Path]:
    """Every module of the package (the engine plugins left out), by dotted name, with its file."""
    found = {}
    for installed, source in installed_sources().items():
        name = ".".join(installed.with_suffix("").parts).removesuffix(".__init__")
        if not name.startswith(EXCLUDED):
            found[name] = source
    return found


def counted_nodes(tree: ast.AST):
    """The tree's nodes, leaving out ``if TYPE_CHECKING:`` and ``if __name__ == "__main__":`` bodies."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If):
            test = ast.unparse(node.test)
            if test in ("TYPE_CHECKING", "typing.TYPE_CHECKING") or test.replace("'", '"') == '__name__ == "__main__"':
                yield from (n for child in node.orelse for n in [child, *counted_nodes(child)])
                continue
        yield node
        yield from counted_nodes(node)


def imports(path: Path, known: set[str]) -> set[str]:
    """The package's modules ``path`` imports."""
    found = set()
    for node in counted_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from package import module`` imports that module; any other name comes from ``node.module`` itself
            names = {f"{node.module}.{a.name}" for a in node.names}
            found |= {n if n in known else node.module for n in names}
    return {n for n in found if n in known}


def layer_of(module: str) -> tuple[int, str]:
    for index, packages in enumerate(LAYERS):
        owner = max((p for p in packages if module == p or module.startswith(p + ".")), key=len, default=None)
        if owner is not None and (owner != "specdec_kit" or module.count(".") <= 1):
            return index, owner
    raise AssertionError(f"{module}: in no layer")


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(path, set(found)) - {name} for name, path in found.items()}


def test_every_import_points_down() -> None:
    wrong = []
    for module, targets in graph().items():
        (level, owner) = layer_of(module)
        for target in targets:
            target_level, target_owner = layer_of(target)
            if target_level > level or (target_level == level and target_owner != owner):
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports against the layers:\n" + "\n".join(sorted(wrong))


RUNTIME_LAYERS = ("core", "models", "drafts", "decoding", "ort")  # bottom up; the runtime's top-level modules above


def runtime_layer(module: str) -> int | None:
    """The runtime sub-package layer of ``module`` (None outside the runtime; its top-level modules rank last)."""
    if not module.startswith("specdec_kit.runtime."):
        return None
    part = module.split(".")[2]
    return RUNTIME_LAYERS.index(part) if part in RUNTIME_LAYERS else len(RUNTIME_LAYERS)


def test_the_runtime_layers_import_down() -> None:
    wrong = [
        f"{module} -> {target}"
        for module, targets in graph().items()
        if (level := runtime_layer(module)) is not None
        for target in targets
        if (runtime_layer(target) or 0) > level
    ]
    assert not wrong, "runtime imports against its layers:\n" + "\n".join(sorted(wrong))


# random and constructed checkpoints for tests; besides the tests only the synthetic demo and a benchmark of a random
# target read them (training, exports and serving never build on a fixture)
FIXTURES = "specdec_kit.runtime.synthetic"
FIXTURE_USERS = {"specdec_kit.runtime.demo", "specdec_kit.bench.runtime_overhead"}


def test_production_code_builds_on_no_test_fixture() -> None:
    users = {module for module, targets in graph().items() if FIXTURES in targets}
    assert users <= FIXTURE_USERS, f"{sorted(users - FIXTURE_USERS)} import the test fixtures of {FIXTURES}"


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles() -> None:
    loops = cycles(graph())
    assert not loops, "modules importing each other:\n" + "\n".join(" <-> ".join(c) for c in loops)


def test_the_checks_catch_what_they_look_for() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    assert layer_of("specdec_kit.bench.speedup") > layer_of("specdec_kit.runtime.core.trees")
    assert layer_of("specdec_kit.paths")[0] == 0 and layer_of("specdec_kit.data.prompts")[0] == 0
    assert runtime_layer("specdec_kit.runtime.core.trees") < runtime_layer("specdec_kit.runtime.ort.graphs")
    assert runtime_layer("specdec_kit.runtime.ort.graphs") < runtime_layer("specdec_kit.runtime.registry")
    source = ast.parse(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x\nif __name__ == '__main__':\n"
        "    import y\ndef f():\n    import z\n"
    )
    imported = {a.name for n in counted_nodes(source) if isinstance(n, ast.Import) for a in n.names}
    assert imported == {"z"}
