"""Offload of a role's parameters / gradients / optimizer state (parallel/offload.py) on a real tiny megatron actor,
one gloo process on the CPU: the same code moves storage off the device (here: into a separate CPU allocation) and
back.  Checked: the contiguous DDP buffers and Adam's moments are really released (0-byte storages), every tensor
comes back with its device, dtype, shape and values and every view aliases its buffer again; an actor / reference
with every offload on computes bitwise what one without computes (log-probs, two updates, weights, optimizer
state); the phase order of loads and offloads; the bf16 Float16Optimizer layout (separate fp32 main params)."""
from __future__ import annotations

import pytest
import torch

from parallel.offload import PARTS, RoleOffload, role_tensors


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoConfig

    from rlhf.quickstart.tiny import make_tiny_hf_model
    from tests.support.dist_utils import one_rank_grid

    with one_rank_grid(tmp_path_factory.mktemp("pg")):
        path = tmp_path_factory.mktemp("tiny")
        make_tiny_hf_model(path, kind="llama_gqa", vocab_size=256, hidden_size=32, num_layers=2,
                           max_position_embeddings=256)
        yield str(path), AutoConfig.from_pretrained(path)


def _cfg(**over):
    from rlhf.config import compose_config

    return compose_config(["actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=2",
                           "actor.log_prob_micro_batch_size_per_gpu=4", "actor.optim.lr=1e-2",
                           "actor.optim.use_distributed_optimizer=true", "actor.use_kl_loss=true",
                           *[f"{k}={v}" for k, v in over.items()]])


def _build(tiny, cfg, role="actor", dtype=torch.float32):
    from parallel.distributed import set_seed
    from parallel.models import build_model_chunks
    from parallel.optim import build_train_state
    from rlhf.workers.actor import MegatronActor
    from rlhf.workers.build import offload_parts, attach_offload, optim_config

    path, hf = tiny
    set_seed(0)
    bundle = build_model_chunks(hf, role, path, params_dtype=dtype)
    state = build_train_state(bundle.chunks, bundle.config, optim_config(cfg.actor.optim)) if role == "actor" else None
    worker = MegatronActor(bundle, state, cfg.actor)
    parts = offload_parts(cfg.actor) if role == "actor" else ["params" if cfg.actor.ref_param_offload else None]
    return attach_offload(worker, parts, role)


def _batch(n=4, seed=0):
    from rlhf.workers.batch import build_batch

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 250, (int(k),), generator=g).tolist() for k in torch.randint(3, 9, (n,), generator=g)]
    responses = [torch.randint(3, 250, (int(k),), generator=g).tolist() for k in torch.randint(2, 7, (n,), generator=g)]
    batch = build_batch(prompts, responses, 0, 6)
    batch["n"] = 1
    return batch


def _update(actor, batch, step):
    from rlhf.workers.losses import PPOPolicyLoss

    g = torch.Generator().manual_seed(step)
    lp = actor.compute_log_prob(batch)["log_probs"]
    batch = dict(batch, old_log_probs=lp + 0.05 * torch.randn(lp.shape, generator=g),
                 advantages=torch.randn(lp.shape, generator=g) * batch["response_mask"],
                 loss_mask=batch["response_mask"].clone(), ref_log_probs=lp.detach().clone())
    return lp, actor.update_policy(batch, PPOPolicyLoss(actor.cfg), step=step)


def _snapshot(state):
    return {part: [(t.device, t.dtype, t.shape, t.clone()) for t in ts]
            for part, ts in role_tensors(state.model, state.optimizer).items()}


def _buffers(state):
    return [b for m in state.model for b in m.buffers]


@pytest.mark.parametrize("dtype,dist_opt", [(torch.float32, True), (torch.bfloat16, False)])
def test_every_tensor_comes_back_and_views_alias_the_buffers(tiny, dtype, dist_opt):
    actor = _build(tiny, _cfg(**{"actor.optim.use_distributed_optimizer": dist_opt}), dtype=dtype)
    _update(actor, _batch(), step=1)  # Adam's moments exist after the first step
    state = actor.state
    before = _snapshot(state)
    assert before["optimizer"] and before["grads"] and before["params"]
    off = RoleOffload(state.model, state.optimizer, torch.device("cpu"), PARTS, "actor")
    off.offload()
    # the contiguous buffers themselves are released, not views of them
    for b in _buffers(state):
        assert b.grad_data.untyped_storage().nbytes() == 0
        assert b.param_data is None or b.param_data.untyped_storage().nbytes() == 0
    for ts in role_tensors(state.model, state.optimizer).values():
        assert all(t.untyped_storage().nbytes() == 0 for t in ts)
    with off.resident():
        after = role_tensors(state.model, state.optimizer)
        for part, ts in after.items():
            assert len(ts) == len(before[part])
            for t, (device, dt, shape, value) in zip(ts, before[part]):
                assert (t.device, t.dtype, t.shape) == (device, dt, shape)
                assert torch.equal(t, value), part
        for m in state.model:
            for b in m.buffers:
                for p in b.params:
                    assert p.main_grad.untyped_storage()._cdata == b.grad_data.untyped_storage()._cdata
                    if b.param_data is not None:  # distributed optimizer: param.data is a view of the buffer
                        assert p.data.untyped_storage()._cdata == b.param_data.untyped_storage()._cdata
                        lo = b.param_data.data_ptr()
                        assert lo <= p.data.data_ptr() < lo + b.param_data.numel() * b.param_data.element_size()
    assert all(t.untyped_storage().nbytes() == 0 for t in role_tensors(state.model, state.optimizer)["params"])
    with pytest.raises(ValueError, match=r"offload parts \['weights'\]"):
        RoleOffload(state.model, state.optimizer, "cpu", ["weights"])


def test_offloaded_roles_train_bitwise_equal_and_in_phase_order(tiny, monkeypatch):
    from rlhf.workers import worker as worker_mod

    plain_cfg = _cfg()
    off_cfg = _cfg(**{"actor.offload.params": True, "actor.offload.grads": True, "actor.offload.optimizer": True,
                      "actor.ref_param_offload": True})
    plain, off = _build(tiny, plain_cfg), _build(tiny, off_cfg)
    ref = _build(tiny, off_cfg, role="reference")
    assert off.offload.log == [("offload", "actor", PARTS)] and ref.offload.log == [("offload", "reference",
                                                                                       ("params",))]
    seen = []
    real = worker_mod.forward_backward

    def spy(model, mb, **kw):  # what is on the device while megatron runs
        seen.append((kw.get("forward_only", True), {p: off.offload.is_offloaded(p) for p in PARTS}))
        return real(model, mb, **kw)

    batch = _batch(8, seed=3)
    torch.testing.assert_close(ref.compute_log_prob(batch)["log_probs"], plain.compute_log_prob(batch)["log_probs"],
                               rtol=0, atol=0)
    assert ref.offload.is_offloaded("params")
    for step in (1, 2):
        lp_plain, m_plain = _update(plain, batch, step)
        monkeypatch.setattr(worker_mod, "forward_backward", spy)
        lp_off, m_off = _update(off, batch, step)
        monkeypatch.setattr(worker_mod, "forward_backward", real)
        assert torch.equal(lp_plain, lp_off)
        assert m_plain == m_off
        assert all(off.offload.is_offloaded(p) for p in PARTS)  # between phases nothing of the actor is resident
    # log-prob forwards ran with the parameters only, the updates with everything
    assert {(fwd, tuple(sorted(k for k, v in res.items() if not v))) for fwd, res in seen} == {
        (True, ("params",)), (False, ("grads", "optimizer", "params"))}
    # (only what was loaded leaves again: the log-prob forward moves the parameters alone)
    assert off.offload.log[1:] == [("load", "actor", ("params",)), ("offload", "actor", ("params",)),
                                   ("load", "actor", PARTS), ("offload", "actor", PARTS)] * 2
    with off.resident():
        for a, b in zip(role_tensors(plain.state.model, plain.state.optimizer).values(),
                        role_tensors(off.state.model, off.state.optimizer).values()):
            assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
        moved = [n for n, p in plain.state.model[0].module.named_parameters()]
        init = _build(tiny, plain_cfg)
        assert any(not torch.equal(p, q) for p, q in zip(off.state.model[0].parameters(),
                                                         init.state.model[0].parameters())), moved[:3]


def test_megatron_optimizer_options_reach_megatron_and_cpu_refuses_what_needs_cuda():
    from megatron.core.optimizer import OptimizerConfig

    from parallel.optim import OptimConfig, check_megatron_optimizer_options, megatron_optimizer_options

    optim = OptimConfig(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0, use_precision_aware_optimizer=True,
                        use_distributed_optimizer=True, exp_avg_dtype="bf16", exp_avg_sq_dtype="torch.float16",
                        main_params_dtype="fp16", main_grads_dtype="bfloat16")
    kw = megatron_optimizer_options(optim)
    assert kw == {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 1.0,
                  "use_precision_aware_optimizer": True, "main_grads_dtype": torch.bfloat16,
                  "main_params_dtype": torch.float16, "exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.float16}
    # megatron's own checks take the offload fields (the precision-aware ones need Transformer Engine to construct)
    c = OptimizerConfig(optimizer="adam", lr=1e-6, use_distributed_optimizer=True,
                        **megatron_optimizer_options(OptimConfig(optimizer_cpu_offload=True,
                                                                 optimizer_offload_fraction=0.25)))
    assert (c.optimizer_cpu_offload, c.optimizer_offload_fraction, c.exp_avg_dtype) == (True, 0.25, torch.float32)
    cpu_offload = OptimConfig(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0)
    check_megatron_optimizer_options(cpu_offload, torch.device("cuda", 0))  # fine on a GPU (never run here)
    with pytest.raises(ValueError, match=r"critic.optim.optimizer_cpu_offload=true needs a CUDA device"):
        check_megatron_optimizer_options(cpu_offload, torch.device("cpu"), "critic")
    no_te = OptimConfig(use_precision_aware_optimizer=True)
    with pytest.raises(ValueError, match=r"actor.optim.use_precision_aware_optimizer=true needs Transformer Engine"):
        check_megatron_optimizer_options(no_te, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"exp_avg_dtype='bf16' needs use_precision_aware_optimizer=true"):
        OptimConfig(exp_avg_dtype="bf16")


def test_cuda_host_buffers_are_exactly_the_offloaded_bytes_and_registered(monkeypatch):
    """On CUDA each host buffer is a plain CPU allocation of exactly the storage's bytes, page-locked with
    cudaHostRegister (portable) and unregistered when it is replaced or freed; torch's caching host allocator
    (pin_memory=True) would round 3000 and 70000 bytes up to 4096 and 131072 and keep freed blocks.  CUDA's runtime
    is a recording stand-in (torch.cuda.cudart())."""
    import gc

    calls = []

    class Cudart:
        def cudaHostRegister(self, ptr, nbytes, flags):
            calls.append(("register", ptr, nbytes, flags))
            return 0

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    off = RoleOffload([], None, "cuda", ())
    a, b = torch.UntypedStorage(3000), torch.UntypedStorage(70000)
    ha, hb = off._host_buffer(a), off._host_buffer(b)
    assert (ha.numel(), hb.numel(), ha.device.type) == (3000, 70000, "cpu")
    assert calls == [("register", ha.data_ptr(), 3000, 1), ("register", hb.data_ptr(), 70000, 1)]
    assert off._host_buffer(a) is ha and len(calls) == 2  # kept between cycles
    old = ha.data_ptr()
    del ha
    a.resize_(5000)  # the storage grew: a new buffer of its new size, the old one unregistered first
    ha = off._host_buffer(a)
    assert calls[2:] == [("unregister", old), ("register", ha.data_ptr(), 5000, 1)]
    ptrs = {ha.data_ptr(), hb.data_ptr()}
    del off, ha, hb
    gc.collect()
    assert {c[1] for c in calls[4:]} == ptrs and all(c[0] == "unregister" for c in calls[4:])
