"""A verl user's MATH run on CPU: verl's command-line keys through ``python -m rlhf.main`` (real SGLang engine,
megatron actor), on a local parquet in the layout verl's ``examples/data_preprocess/math_dataset.py`` writes
(``data_source=DigitalLearningGmbH/MATH-lighteval``, chat-message prompts ending in verl's ``\\boxed{}``
instruction, ``reward_model.ground_truth``), with the quickstart's tiny model warmed up to answer in the boxed
style, 2 GRPO steps.  The rewards come from the MATH rule reward (math-verify); they are read back from
TensorBoard and checked against the boxed answers of the logged validation responses, worked out here by hand
(a regex and the sum of the prompt's operands)."""
from __future__ import annotations

import re

import pytest

from tests.support.dist_utils import main_cmd, run_group
from tests.support.tracking_readers import tensorboard

pytestmark = [pytest.mark.slow, pytest.mark.sglang]

MATH = "DigitalLearningGmbH/MATH-lighteval"
N_VAL = 16


@pytest.fixture(scope="module")
def math_run(tmp_path_factory):
    """(run dir, TensorBoard contents) of the 2-step run."""
    from rlhf.quickstart.arithmetic import BOXED_TASK, write_math_parquet
    from rlhf.quickstart.model import build_quickstart_model

    root = tmp_path_factory.mktemp("verl_math")
    # 160 warm-up steps, 20% of the demonstrations misreport the boxed answer: greedy accuracy ~0.98, sampled
    # (T=1) ~0.25 -- rewards neither all 0 nor all 1; 8 prompts x 4 responses a step (32 samples: all 0 by
    # chance ~1e-4)
    model = build_quickstart_model(str(root / "model"), warmup_steps=160, task=BOXED_TASK, answer_noise=0.2)
    data = write_math_parquet(root / "math", n_train=64, n_test=N_VAL, seed=0)
    out = root / "run"
    cmd = main_cmd([
        "algorithm.adv_estimator=grpo",
        f"data.train_files={data['train']}", f"data.val_files={data['test']}",
        "data.train_batch_size=8", "data.max_prompt_length=64", "data.max_response_length=32",
        "data.filter_overlong_prompts=True", "data.truncation=error",
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.actor.optim.lr=1e-4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16",
        "algorithm.use_kl_in_reward=False",
        "trainer.logger=['console','tensorboard']", "trainer.project_name=verl_grpo_example_math",
        "trainer.experiment_name=tiny_boxed", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
        "trainer.total_training_steps=2", "trainer.save_freq=-1", "trainer.test_freq=2",
        "trainer.val_before_train=False", f"trainer.log_val_generations={N_VAL}", "trainer.progress_bar=false",
        f"trainer.default_local_dir={out}",
    ])
    rc, log = run_group(cmd, 900)
    assert rc == 0, f"exit {rc}:\n{log[-6000:]}"
    return out, tensorboard(str(out / "tensorboard"))


def _rows(markdown: str) -> list[list[str]]:
    """The cells of a markdown table (rlhf.trainer.loggers.markdown_table: ``|`` escaped as ``\\|``)."""
    lines = markdown.strip().splitlines()[2:]  # header, rule
    return [[c.strip().replace("\\|", "|").replace("<br>", "\n") for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            for line in lines]


def test_math_run_has_non_zero_rewards_scored_by_the_math_rule(math_run):
    out, tb = math_run
    s = tb["scalars"]
    train = [s[("critic/score/mean", step)] for step in (1, 2)]
    assert all(r > 0 for r in train), train
    # the validation responses: the boxed answer of each, judged by hand, against the score the run logged
    rows = _rows(tb["text"][("val/generations", 2)])
    assert len(rows) == N_VAL
    right = []
    for data_source, prompt, response, score in rows:
        assert data_source == MATH and "within \\boxed{}." in prompt
        a, b = map(int, re.search(r"What is \$(\d+)\+(\d+)\$\?", prompt).groups())
        boxed = re.findall(r"\\boxed\{(\d+)\}", response)
        right.append(bool(boxed) and int(boxed[-1]) == a + b)
        assert float(score) == float(right[-1]), (prompt, response, score)
    assert sum(right) > 0, rows  # the model answers: a reward that scored all 0 fails above
    assert s[("val/score", 2)] == pytest.approx(sum(right) / N_VAL)
    assert s[(f"val-core/{MATH}/reward/mean@1", 2)] == pytest.approx(sum(right) / N_VAL)
