"""The package's rooms stand on floors: every import between rooms goes down, so no room imports another in a
circle (and no module imports in a circle).

``FLOORS`` lists the rooms from the top (the command line) to the bottom (the policy package): a room may import
its own modules and the rooms of the floors below it, never a room of its own floor or of a floor above. Imports
inside functions count too: a lazy import that closes a circle is still a circle. The modules are read as source
(nothing is imported), so optional simulators need not be installed. The README's Layout section draws these floors.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = {"vla_rl": ROOT / "vla_rl", "vla_rl.envs": ROOT / "envs", "vla_rl.policies": ROOT / "policies"}
# Top to bottom. A room is a package folder or a top-level module.
FLOORS = (
    ("vla_rl.cli",),                                                   # parses the command line, calls a job
    ("vla_rl.train",),                                                 # the jobs: an RL run, SFT, the demo
    ("vla_rl.eval", "vla_rl.interop", "vla_rl.distributed"),           # evaluation; export / serve; Ray
    ("vla_rl.rl", "vla_rl.data"),                                      # the RL algorithm; datasets and demos
    ("vla_rl.checkpoint",),                                            # folders on disk, imported formats
    ("vla_rl.presets",),                                               # presets, overrides, devices
    ("vla_rl.envs", "vla_rl.policies"),                                # envs and their adapters; the policy
    ("vla_rl.core",),                                                  # schema, errors, outputs, progress, threads
)


def module_files() -> dict[str, Path]:
    out = {}
    for package, folder in SOURCES.items():
        for f in folder.rglob("*.py"):
            parts = list(f.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = f
    return out


def imported_modules(name: str, path: Path, known: set[str], tree: ast.AST | None = None) -> set[str]:
    """The project modules ``name`` imports anywhere in its source (or in ``tree``, a part of it). ``from pkg import
    mod`` counts as an import of ``pkg.mod`` alone; the bare top package ``vla_rl`` (whose ``__init__`` imports
    nothing) is left out."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(tree or ast.parse(path.read_text())):
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


def dangling_imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules ``name`` imports that do not exist (a stale path after a move): the graph would drop
    them silently."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    bad = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            module = ".".join(package[: len(package) - (node.level - 1)] + ([node.module] if node.module else [])) \
                if node.level else node.module
            if module.startswith("vla_rl.") and module not in known \
                    and not any(f"{module}.{a.name}" in known for a in node.names):
                bad.add(module)
        elif isinstance(node, ast.Import):
            bad |= {a.name for a in node.names if a.name.startswith("vla_rl.") and a.name not in known}
    return bad


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
    assert "vla_rl.envs.workers" in graph["vla_rl.envs.maniskill"]        # relative
    assert "vla_rl.policies.flow" in graph["vla_rl.rl.algorithms.seam"]   # from vla_rl.policies import flow
    assert "vla_rl.train.trainer" in graph["vla_rl.cli"]                  # inside a function


def test_find_cycle_reports_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_every_import_of_the_project_names_a_module_that_exists():
    files = module_files()
    known = set(files)
    bad = {name: sorted(d) for name, path in files.items() if (d := dangling_imports(name, path, known))}
    assert not bad, f"imports of project modules that do not exist: {bad}"


def test_no_module_imports_in_a_circle():
    assert find_cycle(import_graph()) is None


def room_of(module: str) -> str | None:
    return next((r for floor in FLOORS for r in floor if in_room(module, (r,))), None)


def floor_of(room: str) -> int:
    """0 for the top floor."""
    return next(i for i, floor in enumerate(FLOORS) if room in floor)


def room_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    rooms: dict[str, set[str]] = {r: set() for floor in FLOORS for r in floor}
    for module, deps in graph.items():
        src = room_of(module)
        if src is not None:
            rooms[src] |= {room_of(d) for d in deps if room_of(d) not in (None, src)}
    return rooms


def test_every_module_stands_in_a_room():
    homeless = sorted(m for m in import_graph() if m != "vla_rl" and room_of(m) is None)
    assert not homeless, f"modules in no room of FLOORS (add them to test_layout): {homeless}"


def test_no_room_imports_another_in_a_circle():
    assert find_cycle(room_graph(import_graph())) is None


def test_imports_go_down_the_floors():
    """Every import between rooms goes to a lower floor (envs/ and policies/ share one: neither imports the other)."""
    problems = []
    for module, deps in sorted(import_graph().items()):
        src = room_of(module)
        if src is None:
            continue
        for d in sorted(deps):
            dst = room_of(d)
            if dst is None or dst == src:
                continue
            if floor_of(dst) <= floor_of(src):
                problems.append(f"{module} imports {d} ({dst} is not on a floor below {src})")
    assert not problems, "imports that do not go down:\n" + "\n".join(problems)


# The modules that import the project's own code inside functions on purpose: the command line imports a command's
# job when it runs (so parsing, `--help` and `serve` start without torch or the training packages), and the policy
# package loads its exported-policy reader on first use.
LAZY_BY_DESIGN = ("vla_rl.cli", "vla_rl.policies")


def test_the_projects_own_modules_are_imported_at_the_top():
    """The floors leave no circle for a function-level import to break, so one of the project's own modules is a
    habit that hides what a module needs; optional packages (simulators, Ray, plotting) stay lazy."""
    files = module_files()
    known = set(files)
    lazy = []
    for name, path in files.items():
        if name in LAZY_BY_DESIGN:
            continue
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = ast.Module(body=fn.body, type_ignores=[])
                inner = [n.lineno for n in ast.walk(body) if isinstance(n, (ast.Import, ast.ImportFrom))]
                if inner and imported_modules(name, path, known, tree=body):
                    lazy.append(f"{path.relative_to(ROOT)}:{inner[0]} ({fn.name})")
    assert not lazy, "function-level imports of the project's own modules:\n" + "\n".join(sorted(set(lazy)))


def test_the_rollout_and_the_losses_reach_the_model_through_its_actor_alone():
    """rl/rollout.py and the RL methods never read an attribute ``model`` (``actor.model.prepare`` and the like):
    the actor is the only door to the policy, for the learner's losses too."""
    files = [ROOT / "vla_rl" / "rl" / "rollout.py", *sorted((ROOT / "vla_rl" / "rl" / "algorithms").glob("*.py"))]
    found = [f"{f.name}:{n.lineno}" for f in files for n in ast.walk(ast.parse(f.read_text()))
             if isinstance(n, ast.Attribute) and n.attr == "model"]
    assert not found, found


def test_no_algorithm_is_named_outside_the_algorithms_folder():
    """The Algorithm seam is a rule: outside vla_rl/rl/algorithms/ (the methods and their registry) no string constant
    names a method, so adding one touches its own file, a preset and a test."""
    from vla_rl.rl.algorithms import ALGORITHMS

    found = []
    for name, path in module_files().items():
        if name.startswith("vla_rl.rl.algorithms"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in ALGORITHMS:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}")
    assert not found, "algorithms named outside vla_rl/rl/algorithms/:\n" + "\n".join(found)


def test_every_package_folder_is_installed():
    """A package folder missing from pyproject's explicit list works from a checkout but is absent from a wheel."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join([package, *init.parent.relative_to(folder).parts])
             for package, folder in SOURCES.items() for init in folder.rglob("__init__.py")}
    assert found - listed == set(), "package folders missing from pyproject.toml [tool.setuptools] packages"


def test_no_env_kind_is_named_outside_envs():
    """Code outside envs/ asks the env registry about a kind (its constants and :class:`EnvKind` entries), so a new
    simulator is added in envs/ alone: no string constant equal to a kind's name stands elsewhere."""
    from vla_rl.envs.registry import KINDS

    found = []
    for name, path in module_files().items():
        if name.startswith("vla_rl.envs"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in KINDS:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}")
    assert not found, "env kinds named outside envs/:\n" + "\n".join(found)


def _internal_attributes(cls: type) -> set[str]:
    """What an architecture (and the policies/ classes it derives from) assigns to ``self`` (its layers, heads,
    embeddings) beyond the :class:`~vla_rl.policies.seam.FlowVLA` protocol's own members."""
    import inspect

    from vla_rl.policies.seam import FlowVLA

    protocol = {n for n in dir(FlowVLA) if not n.startswith("__")} | set(FlowVLA.__annotations__)
    assigned = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("vla_rl.policies"):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        assigned |= {t.attr for node in ast.walk(tree) if isinstance(node, ast.Assign) for t in node.targets
                     if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    return assigned - protocol


def test_the_policy_seam_is_the_only_door_to_a_model():
    """Outside policies/, no module builds a model class (make_policy does, from policy.arch) or reads a model's
    layers by attribute (LoRA, recompute, FSDP and the memory plan go through layer_groups()), so a new
    architecture plugs in through vla_rl/policies/architectures.py. Benchmarks and scripts are held to it too."""
    from vla_rl.policies.architectures import ARCHITECTURES, policy_class

    classes = {policy_class(arch) for arch in ARCHITECTURES}
    names = {cls.__name__ for cls in classes}
    internals = set().union(*(_internal_attributes(cls) for cls in classes))
    assert {"vision_blocks", "prefix_layers", "expert_layers", "action_in", "value_head"} <= internals   # seen
    files = [(n, p) for n, p in module_files().items() if not n.startswith("vla_rl.policies")]
    files += [(p.stem, p) for folder in ("benchmarks", "scripts") for p in (ROOT / folder).rglob("*.py")]
    found = []
    for _, path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} builds {node.func.id}")
            if isinstance(node, ast.ImportFrom) and any(a.name in names for a in node.names):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports a model class")
            if isinstance(node, ast.Attribute) and node.attr in internals:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} reads .{node.attr}")
    assert not found, "model internals used outside policies/:\n" + "\n".join(found)
