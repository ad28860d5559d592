"""The package's layers, read from the source: every `import` of every module under jaxalign/ (function-level
imports included, parsed with `ast`, nothing imported) goes to its own package or down a floor, names no private
(`_x`) object of another package, and no two modules import each other, directly or around a loop.

The floors, lowest first (docs/architecture.md):
0. numerics (every numeric decision), metrics (gap metrics on arrays), files (reading users' files), replay_modes,
   report, distributed, version
1. runtime (process settings: XLA flags)
2. model
3. engine (rollout side), checkpoint, interop (other stacks' formats)
4. loading (a model from a preset, a jaxalign checkpoint or a transformers directory)
5. engines (the rollout-engine interface: jaxalign's engine and external ones, e.g. vLLM)
6. rl (the RL loop), align (compare, localize, the precision audit)
7. check, demo
8. cli, and the package itself (`jaxalign/__init__.py`, the public API re-exported)
A package imports its own modules freely (the cycle check still holds there); two packages on one floor do not
import each other."""

import ast
import functools
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jaxalign"

FLOORS = (
    ("numerics", "metrics", "files", "replay_modes", "report", "distributed", "version"),
    ("runtime",),
    ("model",),
    ("engine", "checkpoint", "interop"),
    ("loading",),
    ("engines",),
    ("rl", "align"),
    ("check", "demo"),
    ("cli", ""),
)
FLOOR = {unit: level for level, units in enumerate(FLOORS) for unit in units}


def _modules() -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every .py file under jaxalign/ (a package is its __init__.py)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _unit(module: str) -> str:
    """The floor unit of a module: its first-level package or module under jaxalign ('' for jaxalign itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    is_package = MODULES[module].name == "__init__.py"
    base = base[:len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


@functools.lru_cache(maxsize=None)
def _nodes(path: pathlib.Path) -> tuple[ast.AST, ...]:
    """The import statements of a file, at any depth, except those under `if TYPE_CHECKING:` (annotations only;
    never run)."""
    tree = ast.parse(path.read_text(), str(path))
    skipped = {id(inner) for node in ast.walk(tree)
               if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
               for inner in ast.walk(node)}
    return tuple(node for node in ast.walk(tree)
                 if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skipped)


def _imports(module: str) -> list[tuple[str, str | None, int]]:
    """(imported jaxalign module, the name taken from it or None, line) for every import in `module`'s file. `from
    P import x` where P.x is a module counts as importing P.x."""
    found = []
    for node in _nodes(MODULES[module]):
        if isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names if a.name.split(".")[0] == "jaxalign"]
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, node)
            if source.split(".")[0] != "jaxalign":
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                found.append((sub, None, node.lineno) if sub in MODULES else (source, alias.name, node.lineno))
    return found


def _where(module: str) -> str:
    path = MODULES[module]
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


def _graph() -> dict[str, set[str]]:
    return {m: {target for target, _, _ in _imports(m) if target != m} for m in MODULES}


def test_every_module_has_a_floor_and_the_parser_sees_imports():
    assert set(map(_unit, MODULES)) <= set(FLOOR), sorted(set(map(_unit, MODULES)) - set(FLOOR))
    targets = {t for m in MODULES for t, _, _ in _imports(m)}
    assert targets <= set(MODULES), sorted(targets - set(MODULES))  # every import names a module that exists
    # the parser finds function-level imports too: cli.demo imports jaxalign.demo inside `run`
    assert "jaxalign.demo" in _graph()["jaxalign.cli.demo"]


def test_no_import_from_a_higher_floor_or_a_sibling_package():
    wrong = []
    for module in MODULES:
        for target, _, line in _imports(module):
            here, there = _unit(module), _unit(target)
            if here != there and FLOOR[there] >= FLOOR[here]:
                wrong.append(f"{_where(module)}:{line} ({here or 'jaxalign'}, floor "
                             f"{FLOOR[here]}) imports {target} (floor {FLOOR[there]})")
    assert not wrong, "\n".join(wrong)


def test_no_private_name_is_imported_from_another_package():
    wrong = [f"{_where(module)}:{line} imports {name} from {target}"
             for module in MODULES for target, name, line in _imports(module)
             if name and name.startswith("_") and not name.startswith("__") and _unit(target) != _unit(module)]
    assert not wrong, "\n".join(wrong)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    assert _cycles(_graph()) == []


@pytest.mark.parametrize("source, problem", [
    ("from jaxalign.cli import main\n", "floor"),  # model (floor 2) importing the cli (floor 8)
    ("from jaxalign.engine.engine import _private\n", "private"),
])
def test_the_checks_catch_what_they_forbid(source, problem, monkeypatch, tmp_path):
    """The rules fail on a planted violation (a test that cannot fail proves nothing)."""
    planted = tmp_path / "planted.py"
    planted.write_text(source)
    monkeypatch.setitem(MODULES, "jaxalign.model.planted", planted)
    with pytest.raises(AssertionError, match="planted"):
        (test_no_import_from_a_higher_floor_or_a_sibling_package if problem == "floor"
         else test_no_private_name_is_imported_from_another_package)()


def test_the_cycle_check_finds_a_loop():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
