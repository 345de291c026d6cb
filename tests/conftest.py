"""Fixtures shared by tests/e2e and tests/unit."""
from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray (2 CPUs) for every test of this session that uses Ray in-process (rollout managers, the Ray
    reward model): the first test that asks starts it, the session's end shuts it down, so a start (5-60 s on a
    2-core machine) is paid once instead of once per module.  Reused when something else started Ray already.
    Subprocesses never join it: an in-process ``ray.init()`` sets no RAY_ADDRESS and writes no
    ray_current_cluster file (what `ray start` does), so ``python -m rlhf.main`` runs start their own."""
    import ray

    owned = not ray.is_initialized()
    if owned:
        os.environ.setdefault("RAY_raylet_start_wait_time_s", "300")  # a loaded CI machine starts raylet slowly
        ray.init(num_cpus=2, include_dashboard=False)
    yield ray
    if owned:
        ray.shutdown()


@pytest.fixture(scope="session")
def tok():
    """The quickstart tokenizer (rlhf.quickstart.tokenizer; its chat template speaks hermes tool calls).  A module
    that needs another tokenizer defines its own ``tok``."""
    from rlhf.quickstart.tokenizer import make_quickstart_tokenizer

    return make_quickstart_tokenizer()


@pytest.fixture(scope="session")
def quickstart_model(tmp_path_factory):
    """``get(**kwargs) -> path``: the tiny quickstart model of ``rlhf.quickstart.model.build_quickstart_model(path,
    **kwargs)``, built once per set of arguments for the whole session (a build of the default 300 warm-up steps
    takes ~10 s on an idle 2-core machine; several e2e modules use the same one).  Read-only: a test that writes into
    a model directory builds its own."""
    from rlhf.quickstart.model import build_quickstart_model

    built: dict = {}

    def get(**kwargs) -> str:
        key = tuple(sorted((k, repr(v)) for k, v in kwargs.items()))
        if key not in built:
            built[key] = build_quickstart_model(str(tmp_path_factory.mktemp("quickstart_model") / "model"), **kwargs)
        return built[key]

    return get


@pytest.fixture
def gsm8k_row_file(tmp_path):
    """A one-row GSM8K-shaped jsonl ("2 + 3?", answer "#### 5") for tests that compose a config around a data file."""
    import json

    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"prompt": "2 + 3?", "data_source": "openai/gsm8k", "answer": "#### 5"}) + "\n")
    return str(path)
