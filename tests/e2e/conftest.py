"""Shared torchrun launches of the e2e modules' check scripts.

The check scripts of the same world size run one after another in ONE torchrun launch
(tests/support/dist/run_scripts.py): the ~20 s per process of interpreter start and torch / megatron-core imports
and the process group are paid once per group instead of once per module.  Only the scripts of the modules this
pytest session collected run (``pytest tests/e2e/test_pipeline_vpp.py`` launches vpp_checks.py alone), in the
order below.  A script that patches the process for good comes after every script that would see the patch
(lora_checks.py and device_checks.py put the HF engine double in ``rlhf.workers.rollout.start_rollout``; the engine
scripts after them drive ``RolloutManager`` directly and never call it).  The scripts that start real SGLang
engines (bridge_e2e.py; Ray on rank 0) come last: a launch ends at its first failing script, and an engine that
cannot start on a loaded machine then hides no engine-free check.  family_sync_e2e.py comes after bridge_e2e.py in the
same processes, in the Ray session bridge_e2e.py started (run_scripts.py: one Ray session per launch; a second one in
the same process broke its first sync with "Broken pipe" on rank 0).
"""
from __future__ import annotations

import os
import re

import pytest

from tests.support.dist_utils import collect_checks, run_torchrun
from tests.support.paths import DIST_SCRIPTS

CHECK_LINE = re.compile(r"CHECK (\S+) (PASS|FAIL)")
RUNNER = os.path.join(DIST_SCRIPTS, "run_scripts.py")
#: world size -> [(test module, check script, seconds it may take alone)], in launch order
GROUPS = {
    2: [("test_optim_safety_dist", "optim_safety_checks.py", 900), ("test_pipeline_vpp", "vpp_checks.py", 900),
        ("test_init_checkpoint_dist", "init_checkpoint_checks.py", 900),
        ("test_teacher_layout_dist", "teacher_layout_checks.py", 300),
        ("test_router_replay_dist", "router_replay_checks.py", 600), ("test_lora_dist", "lora_checks.py", 1500),
        ("test_device_discipline", "device_checks.py", 900), ("test_weight_bridge_e2e", "bridge_e2e.py", 1200),
        ("test_family_sync_e2e", "family_sync_e2e.py", 1500)],
    4: [("test_foundation_dist", "foundation_checks.py", 900), ("test_model_families_dist", "family_checks.py", 1500),
        ("test_bridge_holders_dist", "holder_checks.py", 600)],
}


@pytest.fixture(scope="session")
def shared_dist_checks(request, tmp_path_factory):
    """``get(script) -> {name: (passed, detail)}``: the CHECK lines of one check script, from the launch shared
    with the other collected scripts of its world size (run on the first request).  A CHECK name printed by two
    scripts of a launch is reported as failed (its owner would be ambiguous)."""
    collected = {item.module.__name__.rsplit(".", 1)[-1] for item in request.session.items
                 if getattr(item, "module", None) is not None}
    results: dict = {}

    def get(script: str) -> dict:
        if script not in results:
            nproc, group = next((n, g) for n, g in GROUPS.items() if any(s == script for _, s, _ in g))
            wanted = [(s, t) for m, s, t in group if m in collected or s == script]
            out = run_torchrun(RUNNER, nproc=nproc, timeout=sum(t for _, t in wanted),
                               args=["--workdir", str(tmp_path_factory.mktemp(f"dist{nproc}")),
                                     *[os.path.join(DIST_SCRIPTS, s) for s, _ in wanted]])
            checks = collect_checks(out)
            names = [m.group(1) for m in map(CHECK_LINE.search, out.splitlines()) if m]
            for name in {n for n in names if names.count(n) > 1}:
                checks[name] = (False, f"CHECK {name} printed {names.count(name)} times in one shared launch")
            for s, _ in wanted:
                results[s] = checks
        return results[script]

    return get
