"""Layering (DESIGN.md, decision 18): ops ← models ← decode ← the floors above. Each lower floor imports in a fresh
process with every linnet_jax module above it blocked, and linnet_jax's modules import one another without a cycle."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Installed package -> its source directory (pyproject's [tool.setuptools.package-dir]).
PACKAGES = {"linnet_jax": ROOT / "linnet_jax", "linnet_jax.models": ROOT / "models", "linnet_jax.ops": ROOT / "ops"}
# What every floor may import: the package (whose names are imported on first use) and its version.
GROUND = ("linnet_jax", "linnet_jax._version")
# Each lower floor -> the modules (with their submodules) it may import; every other linnet_jax module is blocked.
FLOORS = {
    "linnet_jax.ops": ("linnet_jax.ops",),
    "linnet_jax.models": ("linnet_jax.ops", "linnet_jax.models"),
    "linnet_jax.backend": ("linnet_jax.ops", "linnet_jax.models", "linnet_jax.backend"),
    "linnet_jax.decode": ("linnet_jax.ops", "linnet_jax.models", "linnet_jax.decode"),
}
# Run in a fresh process: a finder ahead of Python's own refuses (and records) every linnet_jax module the
# floor may not import, then the floor is imported. A refusal caught inside the floor still fails the test.
BLOCKED_IMPORT = """
import importlib, sys

floor, allowed, ground = sys.argv[1], tuple(sys.argv[2:]), {ground!r}
refused = []


class Upper:
    def find_spec(self, name, path=None, target=None):
        if name.startswith("linnet_jax.") and name not in ground and not name.startswith(
                tuple(allowed) + tuple(a + "." for a in allowed)):
            refused.append(name)
            raise ImportError(f"{{floor}} may not import {{name}}")
        return None


sys.meta_path.insert(0, Upper())
importlib.import_module(floor)
assert not refused, f"{{floor}} imports {{refused}}"
"""


@pytest.mark.parametrize("floor", FLOORS)
def test_lower_floor_imports_with_the_upper_ones_blocked(floor):
    script = BLOCKED_IMPORT.format(ground=GROUND)
    done = subprocess.run([sys.executable, "-c", script, floor, *FLOORS[floor]], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_generate_and_load_stay_the_functions_whichever_is_imported_first():
    """The package's `generate` and `load` are imported on first use; importing their modules first (as serve
    and the CLI do) must not leave the modules in their place."""
    script = ("import sys\n"
              "from linnet_jax.generate import bucket\n"
              "from linnet_jax.load import DEFAULT_MODEL\n"
              "import linnet_jax\n"
              "from linnet_jax import generate\n"
              "assert linnet_jax.generate is generate is sys.modules['linnet_jax.generate'].generate\n"
              "assert linnet_jax.load is sys.modules['linnet_jax.load'].load\n"
              "assert callable(linnet_jax.Model) and linnet_jax.DEFAULT_MODEL == DEFAULT_MODEL\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def module_name(path: Path) -> str:
    """The installed name of a source file, e.g. models/lora.py -> linnet_jax.models.lora."""
    package, directory = max(((p, d) for p, d in PACKAGES.items() if path.is_relative_to(d)), key=lambda pd: len(pd[0]))
    parts = path.relative_to(directory).with_suffix("").parts
    return ".".join((package, *parts[:-1], *([] if parts[-1] == "__init__" else parts[-1:])))


def sources() -> dict[str, Path]:
    """{module name: source file} of every linnet_jax module."""
    files = {path for directory in PACKAGES.values() for path in directory.rglob("*.py")}
    return {module_name(path): path for path in sorted(files)}


def runtime_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: at module level and inside functions, not under `if TYPE_CHECKING:`."""
    skipped = {id(inner) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
               for statement in node.body for inner in ast.walk(statement)}
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skipped]


def imported_modules(name: str, path: Path, modules) -> set[str]:
    """The linnet_jax modules that module `name` imports itself (not through a parent package)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in runtime_imports(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
            continue
        base = node.module or ""
        if node.level:
            parts = package.split(".")
            base = ".".join([*parts[:len(parts) - node.level + 1], *[base] * bool(base)])
        found |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return found & set(modules)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` ({module: modules it imports}) as [a, b, ..., a], or None."""
    done, path = set(), []

    def visit(node: str) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        path.append(node)
        cycle = next(filter(None, map(visit, sorted(graph[node]))), None)
        path.pop()
        done.add(node)
        return cycle

    return next(filter(None, map(visit, sorted(graph))), None)


def test_no_import_cycle():
    """Counting the imports inside functions too: an upward import deferred into a function is still a cycle of
    the design (as load -> checkpoint -> load was)."""
    modules = sources()
    graph = {name: imported_modules(name, path, modules) - {name} for name, path in modules.items()}
    assert graph["linnet_jax.load"] >= {"linnet_jax.checkpoint", "linnet_jax.files"}  # the graph sees imports
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
