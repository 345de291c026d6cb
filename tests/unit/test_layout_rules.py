"""The project's layout rules, checked on the source (static: nothing is imported):

* no product file over 600 lines (split by idea, not by size: 400 is the guide, 600 the limit);
* no engine call by a method-name string: the rollout engines are called through the typed seam
  (rlhf.rollout.engine.EngineFleet), which the rollout manager implements in full;
* no import cycle between modules of rlhf and parallel (module-level imports; imports inside functions are
  deferred on purpose and may point anywhere the layering allows);
* layers call downward: parallel (the megatron layer) imports nothing from rlhf, rlhf.algorithms are pure
  tensor functions, rollout knows no trainer, the weight bridge and the memory planner know no trainer;
* no private name (``_x``) imported from another package.
"""
import ast
import os
from collections import defaultdict

from tests.support.paths import ROOT
PKGS = [os.path.join(ROOT, "rlhf"), os.path.join(ROOT, "parallel")]

# package -> packages it must not import (at any depth, deferred imports included)
FORBIDDEN = {
    "parallel": ("rlhf",),
    "rlhf.weight_bridge": ("rlhf.trainer", "rlhf.workers", "rlhf.agent", "rlhf.algorithms", "rlhf.rewards", "rlhf.data",
                           "rlhf.config", "rlhf.quickstart", "rlhf.memory_plan"),
    "rlhf.memory_plan": ("rlhf.trainer", "rlhf.workers", "rlhf.agent", "rlhf.algorithms", "rlhf.rewards", "rlhf.data",
                         "rlhf.rollout", "rlhf.weight_bridge", "rlhf.quickstart"),
    "rlhf.algorithms": ("rlhf.trainer", "rlhf.workers", "rlhf.agent", "parallel", "rlhf.rollout", "rlhf.rewards", "rlhf.data",
                        "rlhf.quickstart"),
    "rlhf.rollout": ("rlhf.trainer", "rlhf.workers", "rlhf.agent", "rlhf.algorithms", "rlhf.rewards", "rlhf.data", "rlhf.config",
                     "rlhf.weight_bridge"),
    "rlhf.rewards": ("rlhf.trainer", "rlhf.workers", "rlhf.agent"),
    "rlhf.data": ("rlhf.trainer", "rlhf.workers", "rlhf.agent", "rlhf.rollout", "parallel"),
    "rlhf.workers": ("rlhf.trainer",),
    # the code sandbox is a leaf: rewards (and tools) call it, it calls nothing of rlhf
    "rlhf.sandbox": ("rlhf.trainer", "rlhf.workers", "rlhf.agent", "rlhf.algorithms", "rlhf.rewards", "rlhf.data", "rlhf.config",
                     "rlhf.rollout", "rlhf.weight_bridge", "rlhf.quickstart", "rlhf.memory_plan", "parallel"),
    # the agent loop (multi-turn rollouts) sits between the workers and what they call
    "rlhf.agent": ("rlhf.trainer", "rlhf.workers", "parallel"),
}


def modules():
    out = {}
    for dirpath, _, files in (w for pkg in PKGS for w in os.walk(pkg)):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[rel[:-9] if rel.endswith(".__init__") else rel] = path
    return out


def imports(path, module, top_level_only):
    """(imported module, imported names) of ``path``, relative imports resolved; with ``top_level_only`` the
    imports executed at import time (not those inside functions or classes)."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    pkg = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    todo = [(n, False) for n in tree.body]
    while todo:
        node, nested = todo.pop()
        if isinstance(node, ast.Import) and not (top_level_only and nested):
            for a in node.names:
                yield a.name, []
        elif isinstance(node, ast.ImportFrom) and not (top_level_only and nested):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            yield base, [a.name for a in node.names]
        inner = nested or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda))
        todo += [(c, inner) for c in ast.iter_child_nodes(node)]


def resolve(name, mods):
    """The rlhf/parallel module an import refers to (a submodule import 'pkg.mod' or the package itself)."""
    while name and name not in mods:
        name = name.rsplit(".", 1)[0] if "." in name else ""
    return name or None


MAX_LINES = 600
#: the design's top level (plus docs/ and benchmarks/); dot-files aside, nothing else is tracked there
TOP_LEVEL = {"setup.py", "rlhf", "parallel", "recipes", "scripts", "tests", "Dockerfile", "docs", "benchmarks",
             "README.md"}


def test_top_level_is_the_designs():
    import subprocess

    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    top = {p.split("/", 1)[0] for p in tracked.split()} - {p for p in tracked.split() if p.startswith(".")}
    top = {t for t in top if not t.startswith(".")}
    assert top == TOP_LEVEL, f"top level: extra {sorted(top - TOP_LEVEL)}, missing {sorted(TOP_LEVEL - top)}"


def test_no_product_file_over_600_lines():
    big = {os.path.relpath(p, ROOT): n for p in modules().values() if (n := sum(1 for _ in open(p))) > MAX_LINES}
    assert not big, f"split these by idea: {big}"


def python_files(*tops):
    for top in tops:
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            if "__pycache__" not in dirpath:
                yield from (os.path.join(dirpath, f) for f in files if f.endswith(".py"))


def fleet_methods():
    """The method names of rlhf.rollout.engine.EngineFleet (read from the source)."""
    tree = ast.parse(open(os.path.join(ROOT, "rlhf", "rollout", "engine.py"), encoding="utf-8").read())
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EngineFleet"]
    return {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}


def string_engine_calls(path, names):
    """Calls that name an engine method by a string: ``x.call("m", ...)`` / ``x.call_async("m", ...)``, and
    ``getattr(x, "m")`` / ``getattr(x, variable)`` on an engine method name."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        first = node.args[0]
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in ("call", "call_async") and isinstance(first, ast.Constant) \
                and isinstance(first.value, str):
            out.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} .{f.attr}({first.value!r})")
        if isinstance(f, ast.Name) and f.id == "getattr" and len(node.args) >= 2:
            name = node.args[1]
            if isinstance(name, ast.Constant) and name.value in names:
                out.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} getattr(..., {name.value!r})")
    return out


def test_no_engine_call_by_string():
    names = fleet_methods()
    assert {"begin_weight_update", "update_weights_from_tensor", "update_weights_from_distributed",
            "end_weight_update", "release_memory_occupation", "resume_memory_occupation", "generate"} <= names
    bad = [c for p in python_files("rlhf", "parallel", "scripts", "benchmarks", "tests")
           for c in string_engine_calls(p, names)]
    assert not bad, "call the engines through rlhf.rollout.engine.EngineFleet's methods:\n" + "\n".join(bad)


def test_string_engine_call_detector_finds_both_forms(tmp_path):
    f = tmp_path / "x.py"
    f.write_text('engines.call("begin_weight_update", engines=[0])\ngetattr(actor, "generate")\n'
                 'engines.begin_weight_update()\n')
    found = string_engine_calls(str(f), fleet_methods())
    assert [c.split(" ", 1)[1] for c in found] == [".call('begin_weight_update')", "getattr(..., 'generate')"]


def test_rollout_manager_implements_the_engine_fleet():
    tree = ast.parse(open(os.path.join(ROOT, "rlhf", "rollout", "manager.py"), encoding="utf-8").read())
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RolloutManager"]
    have = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    assert not fleet_methods() - have, f"RolloutManager lacks {sorted(fleet_methods() - have)}"


def test_no_import_cycles_between_modules():
    mods = modules()
    graph = defaultdict(set)
    for m, path in mods.items():
        for name, names in imports(path, m, top_level_only=True):
            for target in [resolve(name, mods)] + [resolve(f"{name}.{n}", mods) for n in names]:
                if target and target != m and not m.startswith(target + "."):  # a package's own __init__ is fine
                    graph[m].add(target)
    seen, stack, cycles = set(), [], []

    def visit(m):
        if m in stack:
            cycles.append(stack[stack.index(m):] + [m])
            return
        if m in seen:
            return
        seen.add(m)
        stack.append(m)
        for t in sorted(graph[m]):
            visit(t)
        stack.pop()

    for m in sorted(mods):
        visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles[:10])


def test_layers_call_downward():
    mods = modules()
    bad = []
    for m, path in mods.items():
        for layer, banned in FORBIDDEN.items():
            if m == layer or m.startswith(layer + "."):
                for name, _ in imports(path, m, top_level_only=False):
                    if any(name == b or name.startswith(b + ".") for b in banned):
                        bad.append(f"{m} imports {name}")
    assert not bad, "\n".join(bad)


def test_no_private_name_imported_from_another_package():
    mods = modules()
    bad = []
    for m, path in mods.items():
        own_pkg = m.rsplit(".", 1)[0] if not path.endswith("__init__.py") else m
        for name, names in imports(path, m, top_level_only=False):
            if not name.startswith(("rlhf", "parallel")):
                continue
            src_pkg = name if (name in mods and mods[name].endswith("__init__.py")) else name.rsplit(".", 1)[0]
            for n in names:
                if n.startswith("_") and not n.startswith("__") and src_pkg != own_pkg:
                    bad.append(f"{m}: from {name} import {n}")
    assert not bad, "\n".join(bad)
