"""The VPP micro-batch rule under torchrun (2 gloo processes, PP2): the actor with virtual pipeline stages (VPP2, one
layer per chunk) on batch sizes whose single micro batch megatron's interleaved schedule refuses.

    torchrun --nproc_per_node=2 tests/support/dist/vpp_checks.py --workdir DIR

Checks (`CHECK <name> PASS|FAIL <detail>` on rank 0, turned into tests by tests/e2e/test_pipeline_vpp.py):
- the no-grad log-probs of 3 sequences (an odd count: padded to 4, 2 micro batches) equal HF's, at PP2 and
  at PP2 x VPP2;
- one PPO update of 4 sequences with ppo_micro_batch_size_per_gpu=4 (VPP: 2 micro batches of 2) gives the same
  loss and gradient norm as without virtual stages (1 micro batch of 4): the split does not change the step;
- at TP2 (this launch's other 2-rank layout), one critic update and one actor update give the same gradient for
  every parameter, and the same grad norm, with sequence parallelism on and off (tests/support/dist/sp_grad_checks.py).
"""
import argparse
import os
import sys
import traceback
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from parallel.distributed import init_distributed, init_model_parallel, set_seed  # noqa: E402
from tests.support.dist.checks import report  # noqa: E402


def batch_of(rows, seed):
    from rlhf.workers.batch import build_batch

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 1000, (3 + i % 2,), generator=g).tolist() for i in range(rows)]
    responses = [torch.randint(4, 1000, (2 + (i * 3) % 4,), generator=g).tolist() for i in range(rows)]
    batch = build_batch(prompts, responses, pad_token_id=3, max_response_length=5)
    batch["n"] = 1
    return batch


def hf_log_probs(path, batch):
    """log p(response token | prefix) from the HF model, [N, R], 0 outside the response."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits
    lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    P = batch["prompt_length"]
    return lp[:, P - 1:] * batch["response_mask"]


def run_layout(path, vpp, actor_cfg):
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig

    from parallel.models import build_model_chunks
    from parallel.optim import OptimConfig, build_train_state
    from rlhf.workers.actor import MegatronActor
    from rlhf.workers.losses import PPOPolicyLoss

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    init_model_parallel(tp=1, pp=2, vpp=vpp)
    set_seed(1)
    bundle = build_model_chunks(AutoConfig.from_pretrained(path), "actor", path)
    assert len(bundle.chunks) == (vpp or 1)
    state = build_train_state(bundle.chunks, bundle.config, OptimConfig(lr=1e-3, use_distributed_optimizer=False))
    actor = MegatronActor(bundle, state, actor_cfg, temperature=1.0)
    odd = batch_of(3, seed=0)
    lp = actor.compute_log_prob(odd)["log_probs"]
    train = batch_of(4, seed=1)
    train["old_log_probs"] = actor.compute_log_prob(train)["log_probs"] - 0.05
    train["advantages"] = torch.tensor([[1.0], [-0.5], [0.25], [-1.0]]).expand(4, 5) * train["response_mask"]
    train["loss_mask"] = train["response_mask"]
    metrics = actor.update_policy(train, PPOPolicyLoss(actor_cfg), step=1)
    return odd, lp, metrics


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    init_distributed()
    path = os.path.join(args.workdir, "model")
    if dist.get_rank() == 0:
        from rlhf.quickstart.tiny import make_tiny_hf_model

        make_tiny_hf_model(path, kind="llama_gqa", num_layers=4)
    dist.barrier()
    from rlhf.config import compose_config

    actor_cfg = compose_config(["actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=4",
                                "actor.log_prob_micro_batch_size_per_gpu=8", "actor.entropy_coeff=0.01"]).actor
    results = {}
    for name, vpp in (("pp2", None), ("pp2vpp2", 2)):
        try:
            odd, lp, metrics = run_layout(path, vpp, actor_cfg)
            results[name] = metrics
            diff = float((lp - hf_log_probs(path, odd)).abs().max())
            report(f"{name}_odd_batch_log_probs_equal_hf", diff < 2e-4, f"max |diff| {diff:.2e}")
        except Exception as e:  # noqa: BLE001 - a crash is this check's failure
            traceback.print_exc()
            report(f"{name}_odd_batch_log_probs_equal_hf", False, f"{type(e).__name__}: {e}"[:400])
    a, b = results.get("pp2"), results.get("pp2vpp2")
    ok = a is not None and b is not None and all(
        abs(a[k] - b[k]) <= 1e-5 * max(1.0, abs(a[k])) for k in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"))
    detail = "" if not ok and (a is None or b is None) else \
        " ".join(f"{k}={a[k]:.6g}/{b[k]:.6g}" for k in ("actor/pg_loss", "actor/grad_norm"))
    report("vpp_update_equals_pp_update", ok, detail)
    from tests.support.dist.sp_grad_checks import SP_CHECKS, check_sp_gradients

    try:
        sp_results = check_sp_gradients(path)
    except Exception as e:  # noqa: BLE001 - a crash fails these checks
        traceback.print_exc()
        sp_results = {name: (False, f"{type(e).__name__}: {e}"[:400]) for name in SP_CHECKS}
    for name, (ok, detail) in sp_results.items():
        report(name, ok, detail)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
