"""The project's layout rules, checked on the source (static: nothing is imported):

* no product file over 400 lines;
* no import cycle between rlhf modules (module-level imports; imports inside functions are deferred on purpose
  and may point anywhere the layering allows);
* layers call downward: rlhf.mcore knows nothing of RL, rlhf.algorithms are pure tensor functions, rollout
  knows no trainer;
* no private name (``_x``) imported from another package.
"""
import ast
import os
from collections import defaultdict

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
PKG = os.path.join(ROOT, "rlhf")

# package -> packages it must not import (at any depth, deferred imports included)
FORBIDDEN = {
    "rlhf.mcore": ("rlhf.trainer", "rlhf.workers", "rlhf.algorithms", "rlhf.rollout", "rlhf.rewards", "rlhf.data",
                   "rlhf.config", "rlhf.quickstart", "rlhf.api", "rlhf.main", "rlhf.cli"),
    "rlhf.algorithms": ("rlhf.trainer", "rlhf.workers", "rlhf.mcore", "rlhf.rollout", "rlhf.rewards", "rlhf.data",
                        "rlhf.quickstart"),
    "rlhf.rollout": ("rlhf.trainer", "rlhf.workers", "rlhf.algorithms", "rlhf.rewards", "rlhf.data", "rlhf.config"),
    "rlhf.rewards": ("rlhf.trainer", "rlhf.workers"),
    "rlhf.data": ("rlhf.trainer", "rlhf.workers", "rlhf.rollout", "rlhf.mcore"),
    "rlhf.workers": ("rlhf.trainer",),
}


def modules():
    out = {}
    for dirpath, _, files in os.walk(PKG):
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
    """The rlhf module an import refers to (a submodule import 'pkg.mod' or the package itself)."""
    while name and name not in mods:
        name = name.rsplit(".", 1)[0] if "." in name else ""
    return name or None


def test_no_product_file_over_400_lines():
    big = {os.path.relpath(p, ROOT): n for p in modules().values() if (n := sum(1 for _ in open(p))) > 400}
    assert not big, f"split these by responsibility: {big}"


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
            if not name.startswith("rlhf"):
                continue
            src_pkg = name if (name in mods and mods[name].endswith("__init__.py")) else name.rsplit(".", 1)[0]
            for n in names:
                if n.startswith("_") and not n.startswith("__") and src_pkg != own_pkg:
                    bad.append(f"{m}: from {name} import {n}")
    assert not bad, "\n".join(bad)
