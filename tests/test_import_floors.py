"""The package's import floors: no module imports from a floor above its own, not even
inside a function, and no modules import each other in a circle.

    floor 0  plain values: the schema, composition, planning (layout, placement, parameter
             counts, FLOPs, memory, communication), the version fences, the families'
             declarations, the job directory's small files, the process exit. None of them imports torch,
             DeepSpeed, Megatron-Core, MLflow or transformers, at any depth: planning stays
             fast and works on a broken install.
    floor 1  validation and the readers it calls (checkpoints, datasets, Hugging Face
             configs, the machine probe), each engine's torch-free rules, the DeepSpeed
             fence (the checkpoint reader takes DeepSpeed's pickled classes from it), and the
             runtime helpers the engines call
    floor 2  engines and adapters (gridwright.engines, gridwright.adapters,
             gridwright.megatron_internals)
    floor 3  launchers and commands (gridwright.launchers, gridwright.evaluations, cli,
             __main__, the worker, sweeps, sync and the MLflow runs)
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
FLOOR_0 = ("gridwright.atomic_io", "gridwright.conf_dir", "gridwright.path_rules", "gridwright.process_exit", "gridwright.config.schema", "gridwright.config.fp8_choice", "gridwright.config.compose", "gridwright.planning.layout",
           "gridwright.planning.placement", "gridwright.planning.model_math", "gridwright.planning.memory_estimate",
           "gridwright.planning.comm_model", "gridwright.planning.disk_space", "gridwright.planning.plan",
           "gridwright.versions", "gridwright.families.declaration",
           "gridwright.families.common", "gridwright.families.registry", "gridwright.families.llama",
           "gridwright.families.mistral", "gridwright.families.mixtral", "gridwright.families.qwen2",
           "gridwright.families.qwen3", "gridwright.families.qwen3_moe", "gridwright.engines.protocol",
           "gridwright.engines.registry", "gridwright.engines.timeouts", "gridwright.engines.zero_settings",
           "gridwright.runtime.heartbeat", "gridwright.runtime.jobdir", "gridwright.runtime.known_warnings",
           "gridwright.runtime.loopback", "gridwright.runtime.process_tree", "gridwright.runtime.outcome",
           "gridwright.runtime.metric_sinks", "gridwright.tracking.run_owner",
           "gridwright.tracking.store", "gridwright.tracking.sweep_report", "gridwright.tracking.headline",
           "gridwright.tracking.runs_view")
FLOOR_2 = ("gridwright.engines", "gridwright.adapters", "gridwright.megatron_internals")
# Inside gridwright.engines, what validation and planning read without loading an engine.
ENGINE_RULES = ("gridwright.engines.registry", "gridwright.engines.protocol", "gridwright.engines.megatron_rules",
                "gridwright.engines.deepspeed_rules", "gridwright.engines.zero_settings")
FLOOR_3 = ("gridwright.launchers", "gridwright.evaluations", "gridwright.cli", "gridwright.__main__",
           "gridwright.runtime.worker", "gridwright.tracking.sweep", "gridwright.tracking.sync",
           "gridwright.tracking.mlflow_runs")
# What floor 0 never imports, at any depth.
HEAVY = ("torch", "deepspeed", "megatron", "mlflow", "transformers", "torchao", "safetensors", "transformer_engine")


def _under(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def floor(module: str) -> int:
    if _under(module, FLOOR_3):
        return 3
    if _under(module, FLOOR_0) or module in {p for p in PACKAGES}:
        return 0  # a package's __init__ holds a docstring only
    if module in ENGINE_RULES:
        return 1
    return 2 if _under(module, FLOOR_2) else 1


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
    assert {"gridwright.config.validation", "gridwright.families.registry", "gridwright.engines.megatron_engine",
            "gridwright.adapters.convert", "gridwright.launchers.local", "gridwright.cli"} <= set(GRAPH)
    unknown = {t for targets in GRAPH.values() for t in targets if t not in GRAPH}
    assert not unknown, f"imports of modules this test does not know: {sorted(unknown)}"


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


@pytest.mark.parametrize("name", sorted(n for n in GRAPH if floor(n) == 0))
def test_the_bottom_floor_imports_no_heavy_package(name):
    """Floor 0 imports only floor 0 (the test above), and none of it imports a heavy
    package even inside a function: composing and planning never load torch."""
    assert not heavy_imports(modules()[name]), f"{name} imports {sorted(heavy_imports(modules()[name]))}"


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
            f"for m in {list(ENGINE_RULES)!r}: importlib.import_module(m)\n"
            "print(sorted(k for k in ('torch', 'deepspeed', 'megatron') if k in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# The one place that picks an engine by name; everything else asks the engine's rules.
ENGINE_BRANCH = re.compile(r'engine\.name\s*(==|!=|in\b|not in\b)|== "deepspeed"|== "megatron"')
PICKS_THE_ENGINE = {"gridwright.engines.registry"}


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
               if not name.startswith("gridwright.engines") and name not in PICKS_THE_ENGINE}
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
