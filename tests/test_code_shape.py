"""The shape of the code, read from its syntax trees: no import circle anywhere in the project; inside `services/`,
imports run from higher layers down (the gateway and the toggle over the workers over the shared wire); no function
in the gateway over 60 lines (STYLE.md 3)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "services", "epdmesh", "kernels", "bench", "sim")
# services' layers, lowest first: a module may import its own layer and those below
LAYERS = [
    ("services.wire", "services.failure", "services.errors"),
    ("services.stage_calls", "services.routing"),
    ("services.encoder", "services.prefill", "services.decoder", "services.worker"),
    ("services.toggle", "services.gateway"),
]
MAX_UPWARD = 3  # the most imports allowed from a lower layer up (issue 32)
MAX_GATEWAY_FUNCTION_LINES = 60


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if path.name.endswith("_pb2.py") or path.name.endswith("_pb2_grpc.py"):
                continue
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module → the project modules it imports (at any depth of its code, lazily or not)."""

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                targets = [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            edges |= {t for t in map(resolve, targets) if t is not None and t != name}
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
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


def _layer(module: str) -> int | None:
    return next(
        (
            i
            for i, layer in enumerate(LAYERS)
            for prefix in layer
            if module == prefix or module.startswith(prefix + ".")
        ),
        None,
    )


def test_the_cycle_finder_finds_a_cycle_and_the_layers_cover_services():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    unlayered = [m for m in _modules() if m.startswith("services.") and _layer(m) is None]
    assert unlayered == [], "give these modules a layer in LAYERS"


def test_no_import_circle_in_the_project():
    assert _cycles(_imports(_modules())) == []


def test_services_import_downwards():
    graph = _imports(_modules())
    upward = sorted(
        f"{m} -> {t}"
        for m, targets in graph.items()
        if m.startswith("services.")
        for t in targets
        if t.startswith("services.") and _layer(m) < _layer(t)
    )
    assert len(upward) <= MAX_UPWARD, upward


def test_no_function_in_the_gateway_is_over_60_lines():
    long = []
    for name, path in _modules().items():
        if name.startswith("services.gateway"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_GATEWAY_FUNCTION_LINES:
                        long.append(f"{name}.{node.name}: {lines}")
    assert long == []
