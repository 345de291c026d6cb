"""verl's code reward (rlhf/rewards/sandbox_code.py) on the local sandbox: the same scores and per-case results as
verl's own sandbox_fusion.compute_score (its two files loaded from the fetched verl copy, pointed at the same
server), verl's sandbox_fusion_url client working against our server, and the config wiring
(reward.sandbox_fusion.url, verl's reward_model.sandbox_fusion.url)."""
import importlib.util
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from rlhf.rewards import UnsupportedDataSourceError, get_reward_fn  # noqa: E402
from rlhf.rewards.sandbox_code import code_reward_overrides, compute_score  # noqa: E402
from rlhf.sandbox import start_local_sandbox  # noqa: E402

VERL_MIRROR = Path("/work/.mirror/volcengine+verl/repo")

ADD = {"inputs": ["1 2\n", "5 7\n", "10 -3\n"], "outputs": ["3\n", "12\n", "7\n"]}
CASES = [  # (completion, test cases): right, partly wrong, runtime error, timeout, no code block, fn_name, asserts
    ("```python\na, b = map(int, input().split())\nprint(a + b)\n```", ADD),
    ("Here:\n```python\na, b = map(int, input().split())\nprint(a + b if a < 9 else 0)\n```", ADD),
    ("```python\nraise SystemExit(input() and 3)\n```", ADD),
    ("```py\nimport time\nwhile True: time.sleep(0.1)\n```", {"inputs": ["1\n"], "outputs": ["1\n"]}),
    ("print(1)", ADD),
    ("```python\ndef add(a, b):\n    return [a + b]\n```",
     {"fn_name": "add", "inputs": ["1\n2", "3\n4"], "outputs": ["[3]", "[8]"]}),
    ("```python\nclass Solution:\n    def twice(self, x):\n        return x * 2\n```",
     json.dumps({"fn_name": "twice", "inputs": ["4"], "outputs": ["8"]})),
    ("```python\ndef sq(x):\n    return x * x\n```", {"assert_case": ["assert sq(3) == 9", "assert sq(2) == 5"]}),
]


@pytest.fixture(scope="module")
def url():
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        pytest.skip("the namespaced sandbox needs Linux and root (CAP_SYS_ADMIN)")
    with start_local_sandbox(isolation="namespaces") as u:
        yield u


@pytest.fixture(scope="module")
def verl_sandbox_fusion(tmp_path_factory):
    """verl's verl/utils/reward_score/sandbox_fusion/{__init__,utils}.py as a standalone package."""
    if not VERL_MIRROR.exists():
        pytest.skip(f"no fetched copy of verl at {VERL_MIRROR}")
    pytest.importorskip("requests")
    pkg = tmp_path_factory.mktemp("verl_sf") / "verl_sandbox_fusion"
    pkg.mkdir()
    for name in ("__init__.py", "utils.py"):
        src = subprocess.run(["git", "--git-dir", str(VERL_MIRROR), "show",
                              f"HEAD:verl/utils/reward_score/sandbox_fusion/{name}"], capture_output=True, text=True)
        if src.returncode:
            pytest.skip(f"verl's sandbox_fusion/{name} is not in the fetched copy")
        (pkg / name).write_text(src.stdout)
    spec = importlib.util.spec_from_file_location("verl_sandbox_fusion", pkg / "__init__.py",
                                                  submodule_search_locations=[str(pkg)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["verl_sandbox_fusion"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_scores_and_case_results_match_verls_function(url, verl_sandbox_fusion):
    sem = threading.Semaphore(8)
    ours, theirs, why = [], [], []
    for completion, tests in CASES:
        copy = (lambda t: json.loads(json.dumps(t)) if isinstance(t, dict) else t)
        s1, m1 = compute_score(url, sem, 512, completion, copy(tests), continuous=True, timeout=4)
        s2, m2 = verl_sandbox_fusion.compute_score(url, sem, 512, completion, copy(tests), continuous=True, timeout=4)
        why += [(m.get("status"), m.get("exit_code"), (m.get("stderr") or "")[-300:]) for m in m1 + m2]
        ours.append((s1, [m.get("status") for m in m1]))
        theirs.append((s2, [m.get("status") for m in m2]))
    assert ours == theirs, why
    # the values themselves (hand-checked): right, 2 of 3, runtime errors, timeout, no code, fn_name 1 of 2, ...
    assert [s for s, _ in ours] == [1.0, 2 / 3, 0.0, 0.0, 0.0, 0.5, 1.0, 0.5]
    assert ours[2][1] == ["runtime_error"] * 3 and ours[3][1] == ["timeout"]


def test_verls_reward_fns_on_the_local_sandbox(url, verl_sandbox_fusion):
    """verl's own client (requests, its payload and status checks) against our server, case by case."""
    res, meta = verl_sandbox_fusion.utils.check_correctness(url, dict(ADD), "print(sum(map(int, input().split())))")
    assert res == [True, True, True] and meta[0]["api_status"] == "Success"
    res, _ = verl_sandbox_fusion.utils.check_correctness(url, dict(ADD), "int main(){", language="cpp")
    assert res == [-4, -4, -4]


def test_code_data_sources_use_the_sandbox_when_configured(url):
    with pytest.raises(UnsupportedDataSourceError):
        get_reward_fn("apps")  # still refused without a sandbox
    assert code_reward_overrides(None) == {}
    fns = code_reward_overrides(url, max_concurrent=4, memory_limit_mb=512)
    assert sorted(fns) == ["apps", "codecontests", "codeforces", "taco"]
    good = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    assert fns["apps"](solution_str=good, ground_truth=json.dumps(ADD)) == 1.0
    assert fns["taco"](solution_str="```python\nprint(3)\n```", ground_truth=ADD) == pytest.approx(1 / 3)


def test_sandbox_fusion_config_keys(url):
    """verl's reward_model.sandbox_fusion.* (and reward.sandbox_fusion.*) reach the reward manager, which then
    scores code data sources in the sandbox; bad values fail at --cfg naming the key."""
    from rlhf.config import compose_config, validate_config
    from rlhf.config.errors import ConfigValidationError
    from rlhf.rewards import build_reward_manager

    c = compose_config([f"reward_model.sandbox_fusion.url={url}", "reward_model.sandbox_fusion.memory_limit_mb=512",
                        "reward.timeout_s=60"])
    assert (c.reward.sandbox_fusion.url, c.reward.sandbox_fusion.memory_limit_mb) == (url, 512)
    mgr = build_reward_manager(c.reward)
    good = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    scores, metrics = mgr.score([good, "```python\nprint(3)\n```"], ["apps", "codecontests"], [json.dumps(ADD), ADD])
    assert list(scores) == pytest.approx([1.0, 1 / 3]) and metrics["reward/num_fallbacks"] == 0
    ok = compose_config(["reward.sandbox_fusion.url=local", "reward.timeout_s=null"])
    validate_config(ok)
    assert ok.reward.sandbox_fusion.url == "local"
    for bad, words in ((["reward.sandbox_fusion.url=ftp://x", "reward.timeout_s=60"], "must be null, local"),
                       (["reward.sandbox_fusion.url=local"], "set reward.timeout_s=120")):
        with pytest.raises(ConfigValidationError, match=words):
            validate_config(compose_config(bad))
