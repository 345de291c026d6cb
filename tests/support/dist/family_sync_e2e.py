"""Weight sync of each model family into a real SGLang CPU engine. Launched by tests/e2e/test_family_sync_e2e.py:

    torchrun --nproc_per_node=2 tests/support/dist/family_sync_e2e.py --workdir DIR

Tiny random models shaped like real releases (tests/support/model_families.py): Llama-3.2 (llama3 rope scaling, tied),
Qwen3 (q/k norm, head_dim != hidden/heads), Qwen3-MoE (8 experts, top-2, norm_topk_prob), Mixtral (8
experts, top-2, w1/w2/w3 expert names, theta 1e6) and DeepSeek-V3 (multi-latent attention, YaRN, 1 dense + 1 MoE
layer: 8 routed experts in 2 groups, sigmoid router with correction bias, a shared expert).  Global rank 0
starts two SGLang engines per family from the initial weights (rollout TP 1, fp32; then one of TP 2, below), each
booting while the engine before it is in use (at most two alive).  First the trainer (TP2, gloo; the MoE's
experts split over TP) builds each model from HF, takes one optimizer step, and the WeightBridge streams the
new weights into that family's engine.  Per family:
  <kind>_initial_equals_hf   the engine's greedy ids on the initial weights == HF `generate`
  deepseek_v3_cached_prefix_equals_hf   the same prompts again (the engine's prefix cache holds them: its
                             prefill takes the absorbed MLA form) == HF `generate`
  <kind>_synced_equals_hf    after the step and the sync: the engine's greedy ids == HF `generate` of the
                             megatron model exported with save_hf_checkpoint (the same weights)
  <kind>_outputs_changed     the step changed the greedy ids (the sync is not a no-op)
  <kind>_check_mode          check="all": every sent tensor SGLang can read back (get_weights_by_name) equals
                             what was sent (Llama: all of them; SGLang's Qwen3 and Mixtral classes read back
                             none: no mismatch, and the greedy check above is the evidence)
  <kind>_every_engine_parameter_equals_disk_load
                             every parameter of every engine TP rank after the sync is bitwise what SGLang's own
                             update_weights_from_disk of the export leaves there
Then expert parallelism: the trainer re-initialised at TP1 x EP2 (each rank holds 4 of the 8 experts) takes
two steps on the MoE and syncs it again (experts gathered over the EP group on the stage leader):
  qwen3_moe_ep2_synced_equals_hf, qwen3_moe_ep2_outputs_changed, qwen3_moe_ep2_check_mode (and its bitwise check)
Then pipeline parallelism, every family: the trainer re-initialised at PP2 (one layer per stage) takes two steps
from the initial weights and syncs into the same engine: <kind>_pp2_synced_equals_hf, <kind>_pp2_outputs_changed
(against the previous phase's greedy ids), <kind>_pp2_check_mode, <kind>_pp2_every_engine_parameter_equals_disk_load.
Then trainer TP1 (DP2: rank 1 a data-parallel replica), the same checks
as <kind>_tp1_*.
Then engine TP2, every family: a new engine of two TP ranks from the initial weights (the TP1 one shut down first),
the trainer at TP2 takes one step and syncs: <kind>_etp2_initial_equals_hf, <kind>_etp2_synced_equals_hf,
<kind>_etp2_outputs_changed, <kind>_etp2_check_mode, <kind>_etp2_every_engine_parameter_equals_disk_load (every
parameter of both engine ranks); then into that engine from trainer
PP2 and from trainer TP1, the same checks as <kind>_etp2_pp2_* and <kind>_etp2_tp1_*.  So every family is synced
from trainer TP1, TP2 and PP2 into engines of TP1 and TP2.
Each check prints `CHECK <name> PASS|FAIL <detail>` on rank 0.
"""
import argparse
import functools
import os
import sys
import traceback
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))

import torch.distributed as dist  # noqa: E402

from parallel.distributed import init_distributed, init_model_parallel, set_seed  # noqa: E402
from tests.support.dist.bridge_e2e import (engine_greedy, hf_greedy, report, synced_equals_disk_load,  # noqa: E402
                                          train_batch)

KINDS = ("llama3", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3")
LR = 5e-2
#: the training batches' seed per phase: each phase steps on batches of its own, so its sync changes the greedy
#: ids the previous phase left (the same batches from the same weights give the same ids at any parallelism)
SEED_OFFSET = {"": 0, "_ep2": 7, "_pp2": 13, "_tp1": 17, "_etp2": 19, "_etp2_pp2": 23, "_etp2_tp1": 29}


def make_models(workdir, kinds=KINDS):
    from rlhf.quickstart.tokenizer import make_quickstart_tokenizer
    from tests.support.model_families import make_family_model

    paths = {k: os.path.join(workdir, f"init_{k}") for k in kinds}
    if dist.get_rank() == 0:
        for kind, path in paths.items():
            make_family_model(path, kind, num_layers=2, seed=3)
            make_quickstart_tokenizer().save_pretrained(path)  # SGLang needs one; ids < 400 < vocab 1000
    dist.barrier()
    return paths


def launch_engine(path, tp=1):
    """Rank 0: one SGLang engine of ``tp`` TP ranks (a RolloutManager of one engine), its Ray actor created now: it
    boots in the background (``engine.start()`` waits for it; the first call that needs it does too)."""
    from rlhf.rollout.manager import RolloutManager

    engine = RolloutManager(1, dict(model_path=path, tp_size=tp, dtype="float32", context_length=128, random_seed=0),
                            start=False)
    engine.launch()
    return engine


class EngineQueue:
    """Rank 0: the run's engines in the order they are used, each launched one engine ahead: while one engine is
    in use the next one boots (at most two alive; each is shut down before the one after the next is launched)."""

    def __init__(self, order):
        self.order, self.live = list(order), {}  # [(kind, tp)], {(kind, tp): RolloutManager}
        self._next = 0
        self._launch_next()
        self._launch_next()

    def _launch_next(self):
        if self._next < len(self.order):
            kind, tp, path = self.order[self._next]
            self.live[(kind, tp)] = launch_engine(path, tp)
            self._next += 1

    def get(self, kind, tp):
        return self.live[(kind, tp)]

    def done(self, kind, tp):
        """Shut the engine down and launch the one after the next."""
        engine = self.live.pop((kind, tp), None)
        if engine is not None:
            engine.shutdown()
            self._launch_next()

    def shutdown(self):
        for key in list(self.live):
            self.live.pop(key).shutdown()


def train_step(bundle, state, seed=11):
    from parallel.forward import forward_backward
    from parallel.optim import optimizer_step, zero_grads

    def loss_fn(outputs, mb):
        mask = mb["attention_mask"].float()
        return -(outputs["log_probs"] * mask).sum() / mask.sum(), {}

    zero_grads(state)
    forward_backward(state.model, train_batch(bundle.spec.vocab_size, seed), kind="log_probs",
                     vocab_size=bundle.spec.vocab_size, loss_fn=loss_fn, forward_only=False, micro_batch_size=1)
    return optimizer_step(state)


def run_family(kind, path, engine, workdir, initial, tag="", steps=1, engine_ready=None):
    """Build the family's trainer model, take ``steps`` optimizer steps, sync into ``engine`` and check it.
    ``initial``: rank 0's greedy ids before this sync; ``engine_ready``: called (every rank) after the steps, before
    the sync, returning ``initial`` (the engine booted meanwhile).  Returns rank 0's greedy ids after the sync."""
    from transformers import AutoConfig

    from parallel.convert import save_hf_checkpoint
    from parallel.models import build_model_chunks
    from parallel.optim import OptimConfig, build_train_state
    from rlhf.weight_bridge import WeightBridge, WeightSyncConfig
    from rlhf.rollout.sampling import stop_token_ids_for

    rank0 = dist.get_rank() == 0
    hf_cfg = AutoConfig.from_pretrained(path)
    bundle = build_model_chunks(hf_cfg, "actor", path)
    state = build_train_state(bundle.chunks, bundle.config,
                              OptimConfig(lr=LR, clip_grad=10.0, use_distributed_optimizer=False))
    for step in range(steps):
        ok_step, gnorm = train_step(bundle, state, seed=11 + step + SEED_OFFSET[tag])
    # HF's greedy ids on the exported weights (the ones the sync sends), before the engine is needed
    out_dir = os.path.join(workdir, f"{kind}{tag}_step{steps}")
    save_hf_checkpoint(state.model, bundle.spec, hf_cfg, out_dir)
    dist.barrier()
    stop = stop_token_ids_for(path)
    ref = hf_greedy(out_dir, stop) if rank0 else None
    if engine_ready is not None:
        initial = engine_ready()
    bridge = WeightBridge(state.model, bundle.spec, engine if rank0 else None,
                          WeightSyncConfig(bucket_bytes=256 * 1024, check="all", group_prefix=f"family_{kind}{tag}"))
    stats = bridge.sync()
    got = engine_greedy(engine, stop) if rank0 else None
    report(f"{kind}{tag}_synced_equals_hf", rank0 and ok_step and got == ref,
           f"{stats.num_buckets} buckets {stats.bytes / 1e6:.2f} MB grad_norm={gnorm:.3f} engine={got} hf={ref}"
           if rank0 else "")
    report(f"{kind}{tag}_outputs_changed", rank0 and got != initial, f"initial={initial} synced={got}")
    c = stats.check  # SGLang 0.5.23's Qwen3 / Qwen3-MoE / Mixtral classes answer get_weights_by_name with None
    readable = c is not None and (bool(c.verified) if kind == "llama3" else
                                  all(why == "engine returned None" for _, why in c.unverifiable))
    report(f"{kind}{tag}_check_mode", rank0 and readable and not c.mismatched,
           f"verified={len(c.verified)} mismatched={c.mismatched} unverifiable={len(c.unverifiable)} "
           f"e.g. {c.unverifiable[:2]}" if rank0 and c is not None else "")
    bridge.close()
    ok, detail = synced_equals_disk_load(engine, out_dir) if rank0 else (False, "")
    report(f"{kind}{tag}_every_engine_parameter_equals_disk_load", ok, detail)
    return got


def initial_check(kind, path, engine, tag=""):
    from rlhf.rollout.sampling import stop_token_ids_for

    stop = stop_token_ids_for(path)
    got, ref = engine_greedy(engine, stop), hf_greedy(path, stop)
    print(f"CHECK {kind}{tag}_initial_equals_hf {'PASS' if got == ref else 'FAIL'} engine={got} hf={ref}", flush=True)
    if kind == "deepseek_v3" and not tag:  # a prefix-cache hit: SGLang's prefill takes the absorbed MLA form then
        again = engine_greedy(engine, stop)
        print(f"CHECK {kind}_cached_prefix_equals_hf {'PASS' if again == ref else 'FAIL'} engine={again} hf={ref}",
              flush=True)
    return got


def main():
    """The engines boot one ahead (:class:`EngineQueue`): a family's TP1 engine boots while the trainer builds and
    steps that family's model (its initial output is checked just before the sync), its TP2 engine while the TP1
    engine's phases run, the next family's TP1 engine while the TP2 engine's run."""
    from megatron.core import parallel_state as ps

    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated families to run (default: all)")
    args = ap.parse_args()
    init_distributed()
    os.makedirs(args.workdir, exist_ok=True)
    paths = make_models(args.workdir, args.kinds.split(","))
    rank0 = dist.get_rank() == 0
    engines = None
    if rank0:
        import ray

        os.environ.setdefault("RAY_raylet_start_wait_time_s", "300")  # a loaded CI machine starts raylet slowly
        os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")  # other jobs' memory must not kill engines
        from rlhf.rollout.ray_cluster import LOCAL_SYSTEM_CONFIG

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 _system_config=dict(LOCAL_SYSTEM_CONFIG))  # no idle workers prestarted (the engines use none)
        engines = EngineQueue([(kind, tp, path) for kind, path in paths.items() for tp in (1, 2)])
    try:
        for kind, path in paths.items():
            engine = engines.get(kind, 1) if rank0 else None
            try:
                if ps.model_parallel_is_initialized():
                    ps.destroy_model_parallel()
                init_model_parallel(tp=2)
                set_seed(1234)

                def engine_ready(kind=kind, path=path, engine=engine, tag=""):
                    initial = None
                    if rank0:
                        engine.start()
                        initial = initial_check(kind, path, engine, tag)
                    dist.barrier()
                    return initial

                synced = run_family(kind, path, engine, args.workdir, None, engine_ready=engine_ready)
                if kind == "qwen3_moe":  # expert parallelism: each rank holds 4 of the 8 experts
                    ps.destroy_model_parallel()
                    init_model_parallel(tp=1, ep=2)
                    synced = run_family(kind, path, engine, args.workdir, synced, tag="_ep2", steps=2)
                # pipeline parallelism: one layer per stage (DeepSeek-V3: the dense layer on stage 0, the MoE
                # layer on stage 1), the embedding on the first stage, the output layer on the last
                ps.destroy_model_parallel()
                init_model_parallel(tp=1, pp=2)
                synced = run_family(kind, path, engine, args.workdir, synced, tag="_pp2", steps=2)
                # trainer TP1: the whole model on each rank (DP2: rank 1 is a data-parallel replica that sends nothing)
                ps.destroy_model_parallel()
                init_model_parallel(tp=1)
                run_family(kind, path, engine, args.workdir, synced, tag="_tp1", steps=2)
                # the engine of two TP ranks (booted meanwhile; the next family's TP1 engine boots once the TP1
                # one is shut down), trainer TP2: each engine rank's shard of fused qkv / gate-up, experts and
                # vocabulary, written by the trainer ranks
                if rank0:
                    engines.done(kind, 1)
                    engine = engines.get(kind, 2)
                ps.destroy_model_parallel()
                init_model_parallel(tp=2)
                synced = run_family(kind, path, engine, args.workdir, None, tag="_etp2",
                                    engine_ready=functools.partial(engine_ready, kind, path, engine, "_etp2"))
                # the same engine of TP2 from trainer PP2, then from trainer TP1 (engine rank r's shard cut out of
                # whole tensors: one trainer rank writes both engine ranks' sections)
                for tag, layout in (("_etp2_pp2", dict(tp=1, pp=2)), ("_etp2_tp1", dict(tp=1))):
                    ps.destroy_model_parallel()
                    init_model_parallel(**layout)
                    synced = run_family(kind, path, engine, args.workdir, synced, tag=tag, steps=2)
                if rank0:
                    engines.done(kind, 2)
            except Exception:
                traceback.print_exc()
                print(f"CHECK {kind}_completed FAIL rank {dist.get_rank()}: exception (see log)", flush=True)
                raise
    finally:
        if rank0:
            import ray

            if engines is not None:
                engines.shutdown()
            ray.shutdown()
    dist.barrier()
    dist.destroy_process_group()

if __name__ == "__main__":
    main()
