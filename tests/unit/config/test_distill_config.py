"""On-policy distillation's config (``distill.*``, rlhf/config/schema/distill.py, rlhf/config/validate.py): the recipe
composes at --cfg, a teacher whose tokenizer is not the student's is refused at --cfg (from the files) and at the
start of a run (rlhf.workers.teacher.resolve_teacher, on the loaded tokenizers) before any model is built, with a
message naming the key and the fix."""
from __future__ import annotations

import pytest

from rlhf.config import ConfigValidationError, compose_config, validate_config
from rlhf.config.validate import config_problems
from rlhf.preflight import files_vocab, vocab_mismatch
from rlhf.main import main
from rlhf.quickstart.tiny import make_tiny_hf_model, make_tiny_tokenizer


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A student and a larger teacher sharing a tokenizer, and a teacher of another tokenizer (another corpus)."""
    root = tmp_path_factory.mktemp("distill_models")
    tok = make_tiny_tokenizer(vocab_size=400)
    other = make_tiny_tokenizer(vocab_size=400, corpus=["completely different words", "zebra quartz jumps"] * 8)
    student = make_tiny_hf_model(str(root / "student"), vocab_size=512, num_layers=2, tokenizer=tok)
    teacher = make_tiny_hf_model(str(root / "teacher"), vocab_size=512, num_layers=4, hidden_size=128,
                                 tokenizer=tok)
    foreign = make_tiny_hf_model(str(root / "foreign"), vocab_size=512, num_layers=2, tokenizer=other)
    return {"student": student, "teacher": teacher, "foreign": foreign, "tok": tok, "root": root}


def _overrides(models, teacher, tmp_path):
    return [f"model.path={models['student']}", "distill.enable=true", f"distill.teacher.path={models[teacher]}",
            f"trainer.default_local_dir={tmp_path}"]


def test_recipe_composes_at_cfg(capsys, tmp_path):
    assert main(["recipe=opd_tiny_cpu", f"trainer.default_local_dir={tmp_path}", "--cfg", "job"]) == 0
    out = capsys.readouterr().out
    assert "distill:\n  enable: true\n  kl_coef: 1.0" in out and "path: tiny://quickstart\n" in out
    assert "path: tiny://quickstart-init" in out  # the student: the quickstart model before its warm-up
    cfg = compose_config([f"trainer.default_local_dir={tmp_path}"], recipe="opd_tiny_cpu")
    validate_config(cfg, world_size=1, check_files=True)


def test_teacher_of_the_same_tokenizer_passes(models, tmp_path):
    cfg = compose_config(_overrides(models, "teacher", tmp_path), recipe="grpo_tiny_cpu")
    assert config_problems(cfg, world_size=1, check_files=True) == []


def test_teacher_of_another_vocabulary_is_refused_at_cfg(models, tmp_path, capsys):
    cfg = compose_config(_overrides(models, "foreign", tmp_path), recipe="grpo_tiny_cpu")
    problems = [p for p in config_problems(cfg, world_size=1, check_files=True) if p.startswith("distill.")]
    assert len(problems) == 1
    p = problems[0]
    assert p.startswith(f"distill.teacher.path={models['foreign']!r}: the teacher's tokenizer is not the student's")
    assert "both must use the same tokenizer" in p and f"(the student's: {models['student']!r})" in p
    # the command line: exit code 2, the message on stderr, before anything is built
    assert main(["recipe=grpo_tiny_cpu", *_overrides(models, "foreign", tmp_path), "--cfg", "job"]) == 2
    assert "the teacher's tokenizer is not the student's" in capsys.readouterr().err


def test_teacher_of_another_vocabulary_is_refused_at_start(models):
    """The ranks' own check (a teacher only a hub name away at --cfg is first on disk here), before any model."""
    from rlhf.workers.teacher import resolve_teacher

    cfg = compose_config([f"model.path={models['student']}", "distill.enable=true",
                          f"distill.teacher.path={models['foreign']}"])
    with pytest.raises(ConfigValidationError, match=r"distill.teacher.path=.*foreign.*the teacher's tokenizer is "
                                                    r"not the student's \(\d+ tokens vs \d+; \d+ of the student's"):
        resolve_teacher(cfg, models["tok"])


def test_vocab_mismatch_names_sizes_and_tokens():
    assert vocab_mismatch({"a": 0, "b": 1}, {"a": 0, "b": 1}) is None
    assert vocab_mismatch({"a": 0, "b": 1}, {"a": 0, "b": 2, "c": 1}) == (
        "the teacher's tokenizer is not the student's (2 tokens vs 3; 1 of the student's tokens have another id or "
        "none in the teacher's, e.g. 'b': 1 vs 2)")
    assert "'c' (teacher only)" in vocab_mismatch({"a": 0}, {"a": 0, "c": 1})


def test_files_vocab_reads_the_saved_tokenizer(models):
    assert files_vocab(models["student"]) == models["tok"].get_vocab()
    assert files_vocab(str(models["root"] / "missing")) is None


def test_distill_settings_are_checked(tmp_path):
    with pytest.raises(ConfigValidationError, match="distill.enable=true needs distill.teacher.path"):
        validate_config(compose_config(["distill.enable=true"]))
    with pytest.raises(ConfigValidationError, match="distill.teacher.path='x' is set but distill.enable=false"):
        validate_config(compose_config(["distill.teacher.path=x"]))
    with pytest.raises(ConfigValidationError, match=r"distill.kl_coef=-0.5 must be >= 0"):
        validate_config(compose_config(["distill.enable=true", "distill.teacher.path=tiny://quickstart",
                                        "distill.kl_coef=-0.5"]))
    with pytest.raises(ConfigValidationError, match="distill.enable=true with algorithm.name=dpo"):
        validate_config(compose_config([f"trainer.default_local_dir={tmp_path}", "distill.enable=true",
                                        "distill.teacher.path=tiny://quickstart"], recipe="dpo_tiny_cpu"))


def test_teacher_grid_of_its_own_is_checked_against_the_world(tmp_path):
    from rlhf.preflight import teacher_layout

    on = ["distill.enable=true", "distill.teacher.path=tiny://quickstart", f"trainer.default_local_dir={tmp_path}",
          "data.train_batch_size=2", "rollout.n=2", "actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2"]
    assert teacher_layout(compose_config(on)) is None  # null sizes: the trainer's grid
    assert teacher_layout(compose_config(on + ["distill.teacher.tensor_model_parallel_size=1"])) is None
    cfg = compose_config(on + ["distill.teacher.tensor_model_parallel_size=4"])
    assert teacher_layout(cfg) == (4, 1)
    validate_config(cfg, world_size=4)  # tp 4 x pp 1 over 4 ranks: teacher DP 1
    with pytest.raises(ConfigValidationError, match=r"distill.teacher.tensor_model_parallel_size=4 x "
                       r"distill.teacher.pipeline_model_parallel_size=1 \(null: the parallel.\* size\) = 4 does not "
                       r"divide the 2 trainer ranks"):
        validate_config(cfg, world_size=2)
    cfg = compose_config(on + ["distill.teacher.pipeline_model_parallel_size=2", "data.train_batch_size=3",
                               "rollout.n=1", "actor.ppo_mini_batch_size=1", "critic.ppo_mini_batch_size=1"])
    assert any("the teacher's data-parallel size 2 does not divide the batch of data.train_batch_size x rollout.n "
               "= 3 sequences" in p for p in config_problems(cfg, world_size=4))
    with pytest.raises(ConfigValidationError, match=r"distill.teacher.tensor_model_parallel_size=0 must be >= 1"):
        validate_config(compose_config(on + ["distill.teacher.tensor_model_parallel_size=0"]))


@pytest.mark.parametrize("typed,nearest", [("distillation.enable=true", "distill.enable"),
                                           ("distillation.teacher.path=x", "distill.teacher.path"),
                                           ("actor_rollout_ref.distillation.enable=true", None)])
def test_misspelt_distill_keys_get_the_nearest_key(typed, nearest, capsys, tmp_path):
    """distillation.enable (ours: distill.enable; verl's: distillation.enabled) was swallowed by the rule that lets
    verl's distillation section pass as "no effect": refused as an unknown key, with the nearest one first."""
    assert main(["recipe=quickstart", f"trainer.default_local_dir={tmp_path}", typed, "--cfg", "job"]) == 2
    err = capsys.readouterr().err
    assert f"Unknown config key {typed.split('=')[0]!r}" in err, err
    if nearest:
        assert f"Did you mean: {nearest}" in err, err
    # verl's own distillation keys still read as "distillation is off"
    assert main(["recipe=quickstart", f"trainer.default_local_dir={tmp_path}", "distillation.nnodes=1",
                 "distillation.teacher_models.teacher_model.model_path=x", "--cfg", "job"]) == 0


def test_moe_teacher_on_its_own_grid_with_the_flex_dispatcher_is_refused_at_cfg(tmp_path):
    """megatron-core's flex dispatcher asserts TP x EP > 1 when a MoE layer is built; a teacher on a grid of its own
    has expert parallel size 1 (parallel.layouts), so at teacher TP 1 a MoE teacher is refused at --cfg (from its
    config.json), naming the teacher's keys and the fixes (exit 2); a dense teacher, teacher TP 2, or the teacher on
    the trainer's grid (with its EP 2) pass."""
    import json

    from rlhf.preflight import distill_problems
    from tests.support.verl_examples import problems, run_cfg
    from tests.unit.config.test_router_replay_config import QWEN3_30B_A3B, QWEN3_DENSE

    for name, config in (("moe", QWEN3_30B_A3B), ("dense", QWEN3_DENSE)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    base = ["distill.enable=true", f"trainer.default_local_dir={tmp_path / 'out'}", "model.moe_token_dispatcher_type=flex",
            "parallel.expert_model_parallel_size=2", "data.train_batch_size=2", "rollout.n=2",
            "actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2"]
    moe = base + [f"distill.teacher.path={tmp_path / 'moe'}"]
    own = ["distill.teacher.pipeline_model_parallel_size=2"]
    want = (f"model.moe_token_dispatcher_type=flex with the MoE teacher distill.teacher.path='{tmp_path / 'moe'}' on a "
            "grid of its own (distill.teacher.tensor_model_parallel_size=null (parallel.tensor_model_parallel_size=1), "
            "distill.teacher.pipeline_model_parallel_size=2): that grid has expert parallel size 1, so TP x EP = 1 "
            "there, and megatron-core's flex dispatcher needs more than one ('Flex token dispatcher requires TPxEP > "
            "1'); set distill.teacher.tensor_model_parallel_size > 1, or both distill.teacher sizes to null (the "
            "teacher sharded like the actor, with its expert parallelism), or model.moe_token_dispatcher_type=alltoall.")
    assert distill_problems(compose_config(moe + own), check_files=True, world_size=2) == [want]
    for fine in (moe,  # the trainer's grid: EP 2
                 moe + ["distill.teacher.tensor_model_parallel_size=2"],  # TP 2 x EP 1
                 moe + own + ["model.moe_token_dispatcher_type=alltoall"],
                 base + [f"distill.teacher.path={tmp_path / 'dense'}"] + own):  # no MoE layer, no dispatcher
        assert distill_problems(compose_config(fine), check_files=True, world_size=2) == [], fine
    code, _, err = run_cfg(["job", *moe, *own])
    assert code == 2 and want in problems(err), err
    # a teacher whose config.json is not at hand at --cfg (tiny://, a hub model not downloaded): refused at build, on
    # the loaded config, before its grid or any model exists
    from transformers import AutoConfig

    from rlhf.workers.teacher import build_teacher

    with pytest.raises(ConfigValidationError) as e:
        build_teacher(compose_config(moe + own), str(tmp_path / "moe"), AutoConfig.from_pretrained(tmp_path / "moe"),
                      temperature=1.0)
    assert e.value.problems == [want]
