"""The on-policy distillation teacher on a megatron grid of its own (``distill.teacher.tensor_model_parallel_size`` /
``pipeline_model_parallel_size``; parallel.layouts.ParallelLayout, rlhf.workers.teacher.build_teacher).  Launched
by tests/e2e/test_teacher_layout_dist.py:

    torchrun --nproc_per_node=2 tests/support/dist/teacher_layout_checks.py --workdir DIR

The trainer's grid is TP1 x PP1 (data parallel 2); the teacher, a tiny random Qwen3 (tests/support/model_families.py,
2 layers, 4 heads), is built three times through build_teacher: in the trainer's grid, at TP2 and at PP2.

  teacher_tp2_is_sharded            the TP2 teacher holds half of each column-parallel weight per rank, the PP2
                                    teacher one of the two layers per rank; the trainer's grid is in place after
  teacher_tp2_log_probs_equal_tp1   per-token log-probs of the same batch equal (<= 1e-5) the TP1 teacher's
  teacher_pp2_log_probs_equal_tp1   the same at PP2
  trainer_grid_restored             after the teacher's forwards: TP1, PP1, DP2 again (and the data-parallel slices)
  ppo_step_with_a_tp2_teacher_equals_tp1   a PPOTrainer step (GRPO + distillation, the HF engine double) with the
                                    teacher (another Qwen3) at TP2: distill/* and actor/pg_loss as at TP1
Each check prints `CHECK <name> PASS|FAIL <detail>` on rank 0.
"""
import argparse
import os
import sys
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))

import torch.distributed as dist  # noqa: E402

from tests.support.dist.checks import run_check  # noqa: E402


def make_model(workdir, name="teacher_qwen3", seed=11):
    from rlhf.quickstart.tokenizer import make_quickstart_tokenizer
    from tests.support.model_families import make_family_model

    path = os.path.join(workdir, name)
    if dist.get_rank() == 0:
        make_family_model(path, "qwen3", num_layers=2, seed=seed)
        make_quickstart_tokenizer().save_pretrained(path)  # ids < 400 < vocab 1000
    dist.barrier()
    return path


def teacher(path, workdir, *extra):
    from transformers import AutoConfig

    from rlhf.config import compose_config
    from rlhf.workers.teacher import build_teacher

    cfg = compose_config([f"model.path={path}", f"trainer.default_local_dir={workdir}", "trainer.logger=[]",
                          "distill.enable=true", f"distill.teacher.path={path}", "data.train_batch_size=2",
                          "rollout.n=2", "data.max_response_length=6", *extra], recipe="quickstart")
    return build_teacher(cfg, path, AutoConfig.from_pretrained(path), temperature=0.7)


def trainer_steps(workdir, student, teacher_path):
    """One PPOTrainer step (GRPO, rollouts from the in-process HF engine double) with the teacher on the trainer's
    grid, then on its own TP2 grid: the distill/ metrics and the actor's loss equal."""
    import rlhf.workers.rollout
    from megatron.core import parallel_state as ps

    from rlhf.config import compose_config
    from rlhf.trainer.ppo_trainer import PPOTrainer
    from tests.support.hf_sampling_engine import start_hf_sampling_engine

    rlhf.workers.rollout.start_rollout = start_hf_sampling_engine
    keys = ("distill/reverse_kl", "distill/teacher_logprob", "distill/student_logprob", "actor/pg_loss")
    out = []
    for extra in ([], ["distill.teacher.tensor_model_parallel_size=2"]):
        ps.destroy_model_parallel()  # the trainer initialises its own grid (and seeds)
        t = PPOTrainer(compose_config([f"model.path={student}", f"trainer.default_local_dir={workdir}/t{len(out)}",
                                       "trainer.logger=[]", "algorithm.adv_estimator=grpo", "data.train_batch_size=2",
                                       "rollout.n=2", "data.max_response_length=6", "actor.ppo_mini_batch_size=2",
                                       "trainer.val_before_train=false", "trainer.progress_bar=false",
                                       "distill.enable=true", f"distill.teacher.path={teacher_path}", *extra],
                                      recipe="quickstart"))
        try:
            m = t.train_step(1)
            out.append([m[k] for k in keys] + [type(t.teacher).__name__])
        finally:
            t.close()
    diffs = [abs(a - b) for a, b in zip(out[0][:-1], out[1][:-1])]
    ok = max(diffs) <= 1e-5 and out[0][0] > 0.01 and out[1][-1] == "LayoutTeacher"
    return ok, f"{dict(zip(keys, out[0]))} vs diffs {diffs}, teachers {out[0][-1]}, {out[1][-1]}"


def grid():
    from megatron.core import parallel_state as ps

    return (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
            ps.get_data_parallel_world_size())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    from parallel.distributed import destroy_distributed, init_distributed, init_model_parallel, set_seed
    from rlhf.workers.batch import build_batch

    init_distributed()
    init_model_parallel(1, 1)
    set_seed(3)
    os.makedirs(args.workdir, exist_ok=True)
    path = make_model(args.workdir)
    base = teacher(path, args.workdir)
    tp2 = teacher(path, args.workdir, "distill.teacher.tensor_model_parallel_size=2")
    pp2 = teacher(path, args.workdir, "distill.teacher.pipeline_model_parallel_size=2")
    batch = build_batch([[5, 17, 230, 9], [44, 3], [7, 7, 120], [300, 2, 8, 9, 10]],
                        [[8, 91, 300], [10, 11, 12, 13], [4], [99, 98, 97, 96, 95]], 0, 6)
    batch["n"] = 1
    want = base.compute_log_prob(batch)["log_probs"]

    def sharded():
        qkv = lambda t: dict(t.chunks[0].named_parameters())["decoder.layers.0.self_attention.linear_qkv.weight"]
        layers = len(pp2.chunks[0].decoder.layers)
        ok = qkv(tp2).shape[0] * 2 == qkv(base).shape[0] and layers == 1 and grid() == (1, 1, 2)
        return ok, f"qkv rows tp2 {qkv(tp2).shape[0]} vs tp1 {qkv(base).shape[0]}; pp2 layers/rank {layers}; " \
                   f"grid {grid()}"

    def equal(other):
        def check():
            got = other.compute_log_prob(batch)["log_probs"]
            d = float((got - want).abs().max())
            return bool(want.abs().sum() > 0) and d <= 1e-5, f"max_abs_diff={d:.2e} shape {tuple(got.shape)}"
        return check

    def restored():
        from rlhf.workers.batch import dp_info

        rank, size, _ = dp_info()
        return grid() == (1, 1, 2) and (rank, size) == (dist.get_rank(), 2), f"grid {grid()} dp {rank}/{size}"

    run_check("teacher_tp2_is_sharded", sharded)
    run_check("teacher_tp2_log_probs_equal_tp1", equal(tp2))
    run_check("teacher_pp2_log_probs_equal_tp1", equal(pp2))
    run_check("trainer_grid_restored", restored)
    student = make_model(args.workdir, "student_qwen3", seed=12)
    run_check("ppo_step_with_a_tp2_teacher_equals_tp1", lambda: trainer_steps(args.workdir, student, path))
    destroy_distributed()


if __name__ == "__main__":
    main()
