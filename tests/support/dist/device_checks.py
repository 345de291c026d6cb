"""Device discipline at DP2 and TP2 under the fake accelerator (tests/support/fake_accelerator.py): every tensor
reaching a collective of megatron's groups is on the device the group takes, as NCCL demands on a GPU run.

    torchrun --nproc_per_node=2 tests/support/dist/device_checks.py --workdir DIR

One launch, two phases in the same two gloo processes (megatron re-initialised between them), rollouts from the
in-process HF engine double (tests/support/hf_sampling_engine.py, fed by the real weight bridge):

  dp2: PPOTrainer (GAE critic, KL in the reward: the reference model), one train_step: actor old log-probs,
       reference log-probs, critic values (DP all-gathers), critic and actor updates, weight sync, the padding
       metric (DP all-reduce).  Then the seam and the guard themselves: role results come back to the caller's
       device; a role method without its door (the seam) and a DP gather without parallel.devices' placement
       (today's main before the fix) are refused with DeviceError.
  tp2: PPOTrainer (GRPO, actor only) at TP2, one train_step: vocab-parallel log-probs (TP all-reduces), the
       update, and the weight sync's TP gathers (rlhf.weight_bridge.topology: batch_isend_irecv), as on a GPU run.

Each check prints `CHECK <name> PASS|FAIL <detail>` on rank 0 (tests/e2e/test_device_discipline.py).
"""
import argparse
import os
import sys
import time
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import rlhf.workers.rollout  # noqa: E402
from tests.support.fake_accelerator import DeviceError, FakeAccelerator, OnAccel  # noqa: E402
from tests.support.hf_sampling_engine import start_hf_sampling_engine  # noqa: E402
from tests.support.dist.checks import run_check  # noqa: E402

rlhf.workers.rollout.start_rollout = start_hf_sampling_engine
T0 = time.time()


def log(msg):
    if dist.get_rank() == 0:
        print(f"[device_checks {time.time() - T0:6.1f}s] {msg}", flush=True)


def trainer(model, workdir, overrides):
    from rlhf.config import compose_config, validate_config
    from rlhf.trainer.ppo_trainer import PPOTrainer

    cfg = compose_config([f"model.path={model}", f"trainer.default_local_dir={workdir}", "trainer.logger=[]",
                          "data.train_batch_size=2", "rollout.n=2", "data.max_response_length=8",
                          "actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2", *overrides],
                         recipe="quickstart")
    validate_config(cfg, world_size=dist.get_world_size())
    return PPOTrainer(cfg)


def roles(t):
    return [r for r in (t.actor, t.reference, t.critic) if r is not None]


def step_check(fa, t, want):
    """One train_step under the guard; every collective in `want` was checked at least once."""
    def check():
        for r in roles(t):
            fa.register_model(r.chunks)
        before = dict(fa.checked)
        m = t.train_step(1)
        ran = {k: fa.checked.get(k, 0) - before.get(k, 0) for k in fa.checked}
        missing = [k for k in want if not ran.get(k)]
        ok = not fa.violations and not missing and 0 < m["perf/padding_efficiency"] <= 1
        return ok, f"checked {ran}, megatron's own {fa.unchecked}, violations {fa.violations[:3]}, missing {missing}"
    return check


def host_batch(t):
    """A small rollout-layout batch built on the host, as the trainer builds one."""
    from rlhf.workers.batch import build_batch

    dp = dist.get_world_size() // t.cfg.parallel.tensor_model_parallel_size
    b = build_batch([[3, 4, 5], [6, 7]] * dp, [[8, 9], [10, 11, 12]] * dp, 0, 4)
    b["n"] = 1
    return b


def dp2_seam_checks(fa, t):
    from rlhf.workers import batch as batch_mod
    from rlhf.workers.batch import dp_info

    def results_on_host():
        b = host_batch(t)
        lp = t.actor.compute_log_prob(b)["log_probs"]
        values = t.critic.compute_values(b)
        bad = [type(x).__name__ for x in (lp, values) if isinstance(x, OnAccel) or x.device.type != "cpu"]
        return not bad and lp.shape == (b["input_ids"].shape[0], 4), f"non-host results {bad}, log_probs {tuple(lp.shape)}"

    def refused(fn):
        fa.raise_on_violation, n = True, len(fa.violations)
        try:
            fn()
        except DeviceError as e:
            del fa.violations[n:]
            return True, str(e)[:160]
        return False, "not refused"

    def no_door():  # the role's computation without its door: what the trainer ran before the seam existed
        return refused(lambda: type(t.actor).compute_log_prob.__wrapped__(t.actor, host_batch(t)))

    def no_placement():  # a host tensor to the DP gather without parallel.devices (dp_all_gather before the fix)
        from unittest import mock

        _, size, group = dp_info()
        with mock.patch.object(batch_mod.devices, "to_group_device", lambda x, g=None: x):
            return refused(lambda: batch_mod.dp_all_gather(torch.ones(2, 3), group, size))

    run_check("dp2_role_results_come_back_on_host", results_on_host)
    run_check("dp2_guard_refuses_a_role_call_without_its_door", no_door)
    run_check("dp2_guard_refuses_a_host_tensor_in_the_dp_gather", no_placement)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    from parallel.distributed import init_distributed

    init_distributed()
    model = os.path.join(args.workdir, "model")
    if dist.get_rank() == 0:
        from rlhf.quickstart.model import build_quickstart_model

        build_quickstart_model(model, warmup_steps=0)
    dist.barrier()
    log("model built")
    with FakeAccelerator() as fa:
        t = trainer(model, os.path.join(args.workdir, "dp2"),
                    ["algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true"])
        log("dp2 trainer built")
        run_check("dp2_ppo_step_every_collective_on_its_group_device",
                  step_check(fa, t, ["all_gather", "all_reduce"]))
        dp2_seam_checks(fa, t)
        t.close()
        log("dp2 done")
        t = trainer(model, os.path.join(args.workdir, "tp2"),
                    ["algorithm.adv_estimator=grpo", "parallel.tensor_model_parallel_size=2"])
        log("tp2 trainer built")
        run_check("tp2_grpo_step_every_collective_on_its_group_device",
                  step_check(fa, t, ["all_reduce", "batch_isend_irecv"]))
        t.close()
        log("tp2 done")
    from parallel.distributed import destroy_distributed

    destroy_distributed()


if __name__ == "__main__":
    main()
