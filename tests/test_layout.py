"""The package's rooms import downhill and nothing imports in a circle.

Order: ``vla_rl.cli`` -> the rooms (``rl``, ``eval``, ``data``, ``interop``, ``distributed``, ``sft``, ``demo``)
-> the plumbing (``config``, ``checkpoint``, ``outputs``, ``env_factory``, ``progress``, ``threads``) -> ``envs``
-> ``policies``. Imports inside functions count too: a lazy import that closes a circle is still a circle. The
modules are read as source (nothing is imported), so optional simulators need not be installed.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = {"vla_rl": ROOT / "vla_rl", "vla_rl.envs": ROOT / "envs", "vla_rl.policies": ROOT / "policies"}
ROOMS = ("vla_rl.rl", "vla_rl.eval", "vla_rl.data", "vla_rl.interop", "vla_rl.distributed", "vla_rl.sft", "vla_rl.demo")
PLUMBING = ("vla_rl.config", "vla_rl.checkpoint", "vla_rl.outputs", "vla_rl.env_factory", "vla_rl.progress",
            "vla_rl.threads")


def module_files() -> dict[str, Path]:
    out = {}
    for package, folder in SOURCES.items():
        for f in folder.rglob("*.py"):
            parts = list(f.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = f
    return out


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules ``name`` imports anywhere in its source. ``from pkg import mod`` counts as an import
    of ``pkg.mod`` alone; the bare top package ``vla_rl`` (whose ``__init__`` imports nothing) is left out."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            subs = {f"{module}.{a.name}" for a in node.names} & known
            found |= subs or {module}
    return (found & known) - {name, "vla_rl"}


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    known = set(files)
    return {name: imported_modules(name, path, known) for name, path in files.items()}


def in_room(module: str, rooms) -> bool:
    return any(module == r or module.startswith(r + ".") for r in rooms)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}   # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_reader_sees_lazy_and_relative_imports():
    graph = import_graph()
    assert "vla_rl.envs.workers" in graph["vla_rl.envs.maniskill"]        # inside a function, relative
    assert "vla_rl.policies.flow" in graph["vla_rl.rl.actor"]             # from vla_rl.policies import flow
    assert "vla_rl.rl.trainer" in graph["vla_rl.cli"]


def test_find_cycle_reports_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_imports_in_a_circle():
    assert find_cycle(import_graph()) is None


def test_imports_go_downhill():
    graph = import_graph()
    problems = []
    for module, deps in sorted(graph.items()):
        if in_room(module, ("vla_rl.policies",)):
            allowed = ("vla_rl.policies",)
        elif in_room(module, ("vla_rl.envs",)):
            # leaf modules of policies/ that import nothing of the project: config ranges, and the keyed random
            # numbers that give an env's initial state and the policy's sampler noise from the same episode seed
            allowed = ("vla_rl.envs", "vla_rl.policies.ranges", "vla_rl.policies.keyed_random")
        elif in_room(module, PLUMBING):
            allowed = (*PLUMBING, "vla_rl.envs", "vla_rl.policies")
        elif in_room(module, ROOMS):
            allowed = (*ROOMS, *PLUMBING, "vla_rl.envs", "vla_rl.policies")
        else:
            assert module in ("vla_rl", "vla_rl.cli"), f"{module} belongs to no room: add it to test_layout"
            continue
        problems += [f"{module} imports {d}" for d in sorted(deps) if not in_room(d, allowed)]
    assert not problems, "imports that go uphill:\n" + "\n".join(problems)


def test_every_package_folder_is_installed():
    """A package folder missing from pyproject's explicit list works from a checkout but is absent from a wheel."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join([package, *init.parent.relative_to(folder).parts])
             for package, folder in SOURCES.items() for init in folder.rglob("__init__.py")}
    assert found - listed == set(), "package folders missing from pyproject.toml [tool.setuptools] packages"
