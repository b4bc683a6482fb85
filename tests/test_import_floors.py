"""The package's floors: each subpackage sits on one floor of `FLOORS` and imports only from
the floors below it, not even inside a function, and no modules import each other in a
circle. Composing, validating and planning import no heavy package at any depth.
"""
import ast
import re
import importlib
import tomllib
from pathlib import Path

import pytest

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
# Every installed package (gridwright.conf holds YAML only).
PACKAGES = [p for p in tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]["packages"] if p != "gridwright.conf"]
# The declared order, ground first: a package may import the packages above it in this
# list and never those below it (docs/development.md draws the same table).
FLOORS = (
    "basics",               # atomic files, path rules, exit codes, the conf folder
    "versions",             # the fences of torch, Megatron-Core, DeepSpeed, transformers
    "families",             # the model families' declarations and Hugging Face configs
    "data",                 # datasets, tokenizers, packing
    "torch_internals",      # the doors to upstream internals: torch (native bindings),
    "megatron_internals",   #   Megatron-Core
    "deepspeed_internals",  #   and DeepSpeed
    "planning",             # layout, placement, FLOPs, memory, communication, disk, the plan
    "config",               # the typed schema, composition, the FP8 choice
    "checkpoints",          # checkpoint folders and the trusted reader
    "runtime",              # the job directory, heartbeats, profiles, the machine probe
    "engine_rules",         # each engine's torch-free rules and the registry
    "analysis",             # trace analysis
    "tracking",             # MLflow runs, sweeps, the store
    "validation",           # every rule a config must pass, with its Fix
    "engines",              # the trainers and the one training loop
    "adapters",             # checkpoint conversion and its verification
    "launchers",            # the agents, the worker, local/multi-node/Slurm launches
    "evaluations",          # benchmarks and checks
    "",                     # gridwright itself: cli and __main__
)
# What these packages never import, at any depth: planning stays fast and works on a
# broken install.
TORCH_FREE = ("basics", "versions", "planning", "config", "engine_rules", "validation")
HEAVY = ("torch", "deepspeed", "megatron", "mlflow", "transformers", "torchao", "safetensors", "transformer_engine")


def _under(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def package(module: str) -> str:
    """The package a module belongs to (a package's __init__ belongs to itself)."""
    return module if module in PACKAGES else module.rsplit(".", 1)[0]


def floor(module: str) -> int:
    return FLOORS.index(package(module).removeprefix("gridwright").removeprefix("."))


def package_roots() -> dict[str, Path]:
    return {pkg: Path(importlib.import_module(pkg).__path__[0]) for pkg in PACKAGES}


def modules() -> dict[str, Path]:
    out = {}
    for pkg, root in package_roots().items():
        for f in sorted(root.glob("*.py")):
            out[pkg if f.stem == "__init__" else f"{pkg}.{f.stem}"] = f
    return out


def imports(name: str, path: Path, known: dict) -> set[str]:
    """Every gridwright module `name` imports, at any depth of its code (functions too)."""
    package = name if path.stem == "__init__" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)):
            targets = [str(node.args[0].value)]  # importlib.import_module("gridwright.x"), __import__(...)
        else:
            continue
        found |= {t for t in targets if t.startswith("gridwright") and t != name}
    return found


GRAPH = {name: imports(name, path, modules()) for name, path in modules().items()}


def test_every_folder_of_code_is_a_package_read_here():
    """A module in a folder pyproject does not list would be neither installed nor walked."""
    roots = set(package_roots().values())
    folders = {f.parent for root in roots for f in root.rglob("*.py")}
    assert folders <= roots, f"folders of code that are no listed package: {sorted(map(str, folders - roots))}"


def test_every_module_was_read():
    assert {"gridwright.validation.validate", "gridwright.families.registry", "gridwright.engines.megatron_engine",
            "gridwright.adapters.convert", "gridwright.launchers.local", "gridwright.cli"} <= set(GRAPH)
    unknown = {t for targets in GRAPH.values() for t in targets if t not in GRAPH}
    assert not unknown, f"imports of modules this test does not know: {sorted(unknown)}"


def test_every_package_has_one_floor():
    """FLOORS names every package once, and nothing else."""
    declared = ["gridwright" + (f".{f}" if f else "") for f in FLOORS]
    assert sorted(declared) == sorted(PACKAGES), set(declared) ^ set(PACKAGES)


@pytest.mark.parametrize("name", sorted(GRAPH))
def test_no_import_from_a_floor_above(name):
    upward = sorted(t for t in GRAPH[name] if floor(t) > floor(name))
    assert not upward, f"{name} (floor {floor(name)}) imports from above: " + ", ".join(
        f"{t} (floor {floor(t)})" for t in upward)


def circles(graph: dict) -> list[list[str]]:
    """Tarjan's strongly connected components: any with two or more modules is a circle."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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


def test_no_circles():
    found = circles(GRAPH)
    assert not found, f"modules importing each other in a circle: {found}"
    # and the search finds one where there is one
    looped = dict(GRAPH, **{"gridwright.adapters.verify_logits": GRAPH["gridwright.adapters.verify_logits"] | {
        "gridwright.adapters.convert"}})
    assert circles(looped)


def test_the_test_catches_an_upward_import(tmp_path):
    """The walk sees imports inside a function, in either form, and the floors rank them."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from ..launchers.local import free_port\n"
                     "    importlib.import_module('gridwright.cli')\n")
    found = imports("gridwright.engines.probe", probe, GRAPH)
    assert found == {"gridwright.launchers.local", "gridwright.cli"}
    assert all(floor(t) > floor("gridwright.engines.probe") for t in found)


def heavy_imports(path: Path) -> set[str]:
    """The heavy packages a module's code imports, at any depth (functions too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        found |= {n.split(".")[0] for n in names if n.split(".")[0] in HEAVY}
    return found


@pytest.mark.parametrize("name", sorted(n for n in GRAPH if package(n).removeprefix("gridwright.") in TORCH_FREE))
def test_composing_validating_and_planning_import_no_heavy_package(name):
    """None of these imports a heavy package even inside a function: composing, validating
    and planning never load torch (the machine probe asks a child process)."""
    assert not heavy_imports(modules()[name]), f"{name} imports {sorted(heavy_imports(modules()[name]))}"


def package_graph(graph: dict) -> dict:
    """Which packages import which, from the modules' imports."""
    out = {}
    for name, targets in graph.items():
        out.setdefault(package(name), set()).update(package(t) for t in targets if package(t) != package(name))
    return out


def test_no_two_packages_import_each_other():
    found = circles(package_graph(GRAPH))
    assert not found, f"packages importing each other in a circle: {found}"
    planted = dict(GRAPH, **{"gridwright.planning.layout": GRAPH["gridwright.planning.layout"] | {
        "gridwright.validation.validate"}})  # planning -> validation -> planning
    assert circles(package_graph(planted))


def test_the_heavy_search_finds_a_lazy_import(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import json\ndef f():\n    import torch.distributed as dist\n    from mlflow import MlflowClient\n")
    assert heavy_imports(probe) == {"torch", "mlflow"}


def test_engine_rules_load_no_torch():
    """Validation reads every engine's rules before anything starts: they must not pull in
    torch, DeepSpeed or Megatron-Core (seconds of imports, and a broken install would break
    planning)."""
    import subprocess
    import sys

    code = ("import sys, importlib\n"
            f"for m in {[n for n in GRAPH if package(n) == 'gridwright.engine_rules']!r}: importlib.import_module(m)\n"
            "print(sorted(k for k in ('torch', 'deepspeed', 'megatron') if k in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# Outside the engines and their rules (where the registry picks an engine by name),
# everything asks the engine's rules.
ENGINE_BRANCH = re.compile(r'engine\.name\s*(==|!=|in\b|not in\b)|== "deepspeed"|== "megatron"')


def engine_branches(path: Path) -> list[str]:
    """Lines of code (not comments or docstrings' prose) that branch on an engine's name."""
    found = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        code = line.split("#", 1)[0]
        if ENGINE_BRANCH.search(code):
            found.append(f"{path.name}:{number}: {line.strip()}")
    return found


def test_no_engine_branches_outside_the_engines():
    """Engine policy lives with the engine (its rules module, its trainer): a branch on the
    engine's name anywhere else is a rule in the wrong place."""
    outside = {name: path for name, path in modules().items()
               if package(name) not in ("gridwright.engines", "gridwright.engine_rules")}
    found = [line for path in outside.values() for line in engine_branches(path)]
    assert not found, "engine branches outside gridwright.engines:\n" + "\n".join(found)


def test_the_branch_search_finds_a_branch(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('if cfg.engine.name == "deepspeed":\n    pass\nprint(f"engine {cfg.engine.name}")\n'
                     'tags = {"engine": cfg.engine.name}\nok = cfg.engine.name in ENGINES\n')
    assert engine_branches(probe) == ['probe.py:1: if cfg.engine.name == "deepspeed":',
                                      'probe.py:5: ok = cfg.engine.name in ENGINES']


# MLflow's calls that start or end a run's life.
RUN_LIFECYCLE = {"create_run", "set_terminated", "update_run", "start_run", "end_run"}
# gridwright's own: the job's run is opened and closed by its owner, node 0's agent.
OWNER_CALLS = {"open_run", "close_run"}


def calls_named(path: Path, names: set[str]) -> list[str]:
    """`x.name(...)` and `name(...)` calls of any of `names` in a module's code."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            called = getattr(node.func, "attr", getattr(node.func, "id", None))
            if called in names:
                found.append(f"{path.name}:{node.lineno}: {called}")
    return found


def test_one_module_opens_and_closes_mlflow_runs():
    """MLflow's run lifecycle is called from gridwright.tracking.mlflow_runs only, and its
    open_run/close_run from the job's owner only (the agent): no second place decides when
    a job's run starts or ends."""
    lifecycle = {name: calls_named(path, RUN_LIFECYCLE) for name, path in modules().items()}
    assert {n for n, found in lifecycle.items() if found} == {"gridwright.tracking.mlflow_runs"}, lifecycle
    owners = {name for name, path in modules().items() if calls_named(path, OWNER_CALLS)}
    assert owners == {"gridwright.tracking.mlflow_runs", "gridwright.launchers.agent"}, owners


def test_the_call_search_finds_a_call(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("client.set_terminated(run_id)\nopen_run(cfg, job_dir)\nprint('create_run')\n")
    assert calls_named(probe, RUN_LIFECYCLE | OWNER_CALLS) == ["probe.py:1: set_terminated", "probe.py:2: open_run"]
