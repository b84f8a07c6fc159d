"""The import layering of docs/ARCHITECTURE.md holds: each part of qkv imports only from the parts
below it, and there are no cycles between parts. Imports inside functions count too."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "qkv"

# part -> layer; a part may import from its own layer and the layers below (lower numbers)
LAYERS = {
    "__version__": 0,  # ``from qkv import __version__``: a string the package defines, nothing imported
    "errors": 0, "config": 0, "files": 0, "masks": 0, "metrics": 0, "bounds": 0, "startup": 0,
    "nn": 1, "data": 1, "losses": 1, "checkpoint": 1, "bptt": 1,
    "models": 2,
    "decoding": 3,
    "tasks": 4,
    "frontends": 5, "training": 5, "importers": 5,
    "cli": 6, "cli_options": 6, "export": 6,
    "engines": 6,  # CTranslate2 running qkv's models: the exporter's converter and cache (export/) under the front-ends
    "serve": 6, "viz": 6, "info": 6, "complexity": 6, "long_range": 6, "lab": 6, "__init__": 6,
    "__main__": 6,
    "lab": 6,  # qkv lab: its concept panels call nn/, masks and complexity
}
# parts of one layer that must not import each other
FORBIDDEN = {("frontends", "training"), ("training", "frontends")}
# the old module names kept for code written against them (each is the same module as the new one)
ALIASES = {("training", "checkpoint"), ("training", "losses"), ("training", "bptt")}


def part_of(module: str) -> str:
    """qkv.tasks.lm -> tasks; qkv.cli -> cli; qkv -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(path: Path) -> set[str]:
    """Every qkv module that ``path`` imports, at any depth of the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "qkv"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                node.module.split(".")[0] == "qkv":
            found.add(node.module if node.module != "qkv" else "qkv." + node.names[0].name)
    return found


def edges() -> set[tuple[str, str, str]]:
    out = set()
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC.parent).with_suffix("")
        module = ".".join(rel.parts)
        src = part_of(module)
        for target in imports(path):
            dst = part_of(target)
            if dst != src and (src, dst) not in ALIASES:
                out.add((src, dst, f"{module} imports {target}"))
    return out


def test_every_part_has_a_layer():
    parts = {part_of(".".join(p.relative_to(SRC.parent).with_suffix("").parts)) for p in SRC.rglob("*.py")}
    assert parts <= LAYERS.keys(), f"give these a layer in docs/ARCHITECTURE.md and here: {parts - LAYERS.keys()}"


def test_each_part_imports_only_from_below():
    wrong = sorted(why for src, dst, why in edges()
                   if LAYERS[dst] > LAYERS[src] or (src, dst) in FORBIDDEN)
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_no_cycles_between_parts():
    graph: dict[str, set[str]] = {}
    for src, dst, _ in edges():
        graph.setdefault(src, set()).add(dst)

    def reaches(a: str, b: str, seen: set[str]) -> bool:
        for n in graph.get(a, ()):
            if n == b or (n not in seen and (seen.add(n) or reaches(n, b, seen))):
                return True
        return False

    cycles = sorted({tuple(sorted((a, b))) for a in graph for b in graph[a] if reaches(b, a, set())})
    assert not cycles, f"import cycles between parts: {cycles}"


def test_inference_does_not_need_the_training_package():
    """Front-ends, and everything they import, never import qkv.training."""
    import subprocess
    import sys

    code = ("import sys, qkv, qkv.frontends; qkv.frontends.load; "
            "print(sorted(m for m in sys.modules if m.startswith('qkv.training')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", out


def module_graph() -> dict[str, set[str]]:
    """Module -> the qkv modules it imports (at any depth of the file; a package's import of a name of
    ``qkv.x.y`` counts as an import of that module when it is one)."""
    modules = {".".join(p.relative_to(SRC.parent).with_suffix("").parts).removesuffix(".__init__")
               for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        module = ".".join(path.relative_to(SRC.parent).with_suffix("").parts).removesuffix(".__init__")
        graph[module] = {t for t in imports(path) if t in modules and t != module}
    return graph


def test_no_cycles_between_modules():
    """No module imports, directly or through others, a module that imports it back (a function-level
    import included): a circle of imports works only in the order Python happens to meet it. A package
    importing its own submodules is its interface, not a circle, and is left out."""
    graph = module_graph()

    def reaches(a: str, b: str) -> bool:
        seen, todo = set(), [a]
        while todo:
            n = todo.pop()
            for m in graph.get(n, ()):
                if m == b:
                    return True
                if m not in seen:
                    seen.add(m)
                    todo.append(m)
        return False

    cycles = sorted({tuple(sorted((a, b))) for a in graph for b in graph[a]
                     if not b.startswith(a + ".") and not a.startswith(b + ".") and reaches(b, a)})
    assert not cycles, f"import cycles between modules: {cycles}"
