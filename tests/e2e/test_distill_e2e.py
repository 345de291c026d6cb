"""On-policy distillation through the PPO trainer (recipe opd_tiny_cpu, CPU, 3 short steps): the teacher scores
the student's rollouts and the ``distill/`` metrics are written, finite.

Step 1 runs with the teacher = the student's own initial weights (``tiny://quickstart-init`` both): the reverse KL
of every token is 0 (same model, same temperature), which pins the wiring (the teacher's log-probs of the student's
tokens, aligned with ``old_log_probs``).  Then the recipe's teacher (``tiny://quickstart``, the warmed-up model) is
built in its place and steps 2-3 show a positive, finite KL.  The rollouts come from tests/support/
hf_sampling_engine.py (no SGLang start; the engine path of OPD is the ordinary PPO one).  The 10-step learning
claim (KL falls, score rises) is measured in docs/algorithms.md, not here.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest

from tests.support.paths import ROOT
from tests.support.tracking_readers import run_series as scalars

pytestmark = [pytest.mark.slow]

DRIVER = """
import json, sys
import rlhf.workers.rollout
from tests.support.hf_sampling_engine import start_hf_sampling_engine
rlhf.workers.rollout.start_rollout = start_hf_sampling_engine
from rlhf.config import compose_config, validate_config
from rlhf.trainer.ppo_trainer import PPOTrainer, log_prob_temperature
from rlhf.trainer.tracking import Tracking
from rlhf.workers.teacher import build_teacher, resolve_teacher

cfg = compose_config(json.loads(sys.argv[1]), recipe="opd_tiny_cpu")
validate_config(cfg, world_size=1, check_files=True)
trainer = PPOTrainer(cfg)
trainer.tracker = Tracking.from_config(cfg, enabled=True)
try:
    for step in (1, 2, 3):
        if step == 2:  # the recipe's teacher: the warmed-up model
            cfg.distill.teacher.path = "tiny://quickstart"
            trainer.teacher = build_teacher(cfg, *resolve_teacher(cfg, trainer.tokenizer),
                                            temperature=log_prob_temperature(cfg))
        m = trainer.train_step(step)
        m.pop("_tokens")
        trainer.tracker.log(m, step)
        print("STEP " + json.dumps({k: v for k, v in m.items() if k.startswith("distill/")}), flush=True)
finally:
    trainer.close()
"""


def test_distill_metrics_through_the_trainer(tmp_path):
    out_dir = tmp_path / "opd"
    overrides = [f"trainer.default_local_dir={out_dir}", "trainer.logger=[tensorboard]", "trainer.progress_bar=false",
                 "distill.teacher.path=tiny://quickstart-init", "data.train_batch_size=4", "rollout.n=4",
                 "actor.ppo_mini_batch_size=2"]
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(DRIVER))
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, str(script), json.dumps(overrides)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{out[-6000:]}"
    steps = [json.loads(line[5:]) for line in out.splitlines() if line.startswith("STEP ")]
    assert len(steps) == 3
    # teacher = the student's weights: every token's log pi_student - log pi_teacher is 0
    assert abs(steps[0]["distill/reverse_kl"]) < 1e-5
    assert max(abs(steps[0]["distill/reverse_kl_max"]), abs(steps[0]["distill/reverse_kl_min"])) < 1e-4
    assert steps[0]["distill/teacher_logprob"] == pytest.approx(steps[0]["distill/student_logprob"], abs=1e-5)
    # the warmed-up teacher: the unwarmed student is far from it (KL in nats per token), and finite
    for m in steps[1:]:
        assert math.isfinite(m["distill/reverse_kl"]) and m["distill/reverse_kl"] > 0.5
        assert m["distill/teacher_logprob"] < m["distill/student_logprob"] < 0
    s = scalars(out_dir)
    for tag in ("distill/reverse_kl", "distill/teacher_logprob", "distill/student_logprob", "distill/reverse_kl_seq",
                "distill/kl_coef", "timing_s/teacher", "critic/score/mean", "actor/pg_loss"):
        assert sorted(s.get(tag, {})) == [1, 2, 3], tag
        assert all(math.isfinite(v) for v in s[tag].values()), tag
