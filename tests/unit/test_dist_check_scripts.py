"""The torchrun check scripts (tests/support/dist/) share one CHECK-line protocol, tests/support/dist/checks.py: its
verdict merging by hand, its lines on a one-rank gloo group as tests.support.dist_utils.collect_checks reads them, and
that no script defines its own report / run_check again."""
from __future__ import annotations

import ast
import os

from tests.support.paths import DIST_SCRIPTS as DIST


def test_merge_verdicts_by_hand():
    from tests.support.dist.checks import merge_verdicts

    assert merge_verdicts([(True, ""), (True, "")]) == (True, "")
    assert merge_verdicts([(True, "err 1e-7"), (True, "err 1e-7")]) == (True, "err 1e-7")  # the same: once
    assert merge_verdicts([(True, "a"), (False, "b")]) == (False, "rank 0: a; rank 1: b")
    assert merge_verdicts([(True, ""), (False, "b")]) == (False, "b")


def test_lines_on_one_rank(tmp_path, capsys):
    import pytest

    import torch.distributed as dist

    from tests.support.dist import checks
    from tests.support.dist_utils import collect_checks

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this pytest process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        start = len(checks.RESULTS)
        assert checks.report("a", True, "two\nlines") is True
        assert checks.report_rank0("b", 0, "x") is False
        assert checks.run_check("c", lambda: 1 / 0) is False
        assert checks.run_check("d", lambda: (True, "fine"), rank0=True) is True
        del checks.RESULTS[:start]  # the summary counts this process's checks: here these four
        checks.summary()
    finally:
        dist.destroy_process_group()
    out = capsys.readouterr().out
    assert "SUMMARY 2 passed, 2 failed" in out, out
    got = collect_checks(out)
    assert {k: v for k, v in got.items() if k != "_tail"} == {
        "a": (True, "two lines"), "b": (False, "x"), "c": (False, "ZeroDivisionError: division by zero"),
        "d": (True, "fine")}
    assert checks.RESULTS == [("a", True), ("b", False), ("c", False), ("d", True)]


def test_no_script_defines_its_own_report():
    """Every script takes report / run_check / RESULTS from tests/support/dist/checks.py (one protocol, one place)."""
    own = []
    for name in sorted(os.listdir(DIST)):
        if not name.endswith(".py") or name == "checks.py":
            continue
        tree = ast.parse(open(os.path.join(DIST, name)).read())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name in ("report", "run_check"):
                own.append(f"{name}:{node.lineno} def {node.name}")
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "RESULTS" for t in node.targets):
                own.append(f"{name}:{node.lineno} RESULTS")
    assert not own, own
