"""MoE routing replay (parallel/router_replay.py) on a real tiny Qwen3-MoE megatron model, one gloo process (TP1):
replayed routing equals the given indices token by token, replaying the model's own routing changes no log-prob,
replaying other experts changes them, and the agreement metric against hand-counted pairs; the reference and the
critic route on their own under R3 (as verl's), the LoRA reference replays through the actor's forward.  EP2 and PP2 run in
tests/support/dist/router_replay_checks.py (tests/e2e/test_router_replay_dist.py)."""
from __future__ import annotations

import pytest
import torch

from parallel.router_replay import filler, pad_routing, routing_agreement


def test_routing_agreement_counts_pairs_by_hand():
    # 1 row, 3 tokens, 2 layers, top-2; layer 1 of token 2 differs, token 0 is masked out
    eng = torch.tensor([[[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[1, 2], [3, 4]]]])
    tr = eng.clone()
    tr[0, 0] = torch.tensor([[7, 6], [5, 4]])  # masked: not counted
    tr[0, 1, 0] = torch.tensor([5, 4])  # same set, other order: agrees
    tr[0, 2, 1] = torch.tensor([3, 5])  # one expert differs
    mask = torch.tensor([[0, 1, 1]])
    assert routing_agreement(tr, eng, mask) == (3.0, 4.0)
    # dense layers (-1) are skipped
    tr[..., 1, :] = -1
    assert routing_agreement(tr, eng, mask) == (2.0, 2.0)


def test_filler_and_pad_are_valid_distinct_experts():
    f = filler((2, 3), 4)
    assert f.shape == (2, 3, 4) and (f == torch.arange(4)).all()
    r = torch.full((1, 2, 3, 2), 7)
    p = pad_routing(r, 2)
    assert p.shape == (1, 4, 3, 2) and (p[:, :2] == 7).all() and (p[:, 2:] == torch.tensor([0, 1])).all()


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    """A tiny Qwen3-MoE HF directory (2 layers, 8 experts, top-2), with the module's one-rank megatron grid up (and
    parallel.distributed.set_seed's CPU patches applied, as a trainer does before building)."""
    from parallel.distributed import set_seed
    from tests.support.dist_utils import one_rank_grid
    from tests.support.model_families import make_family_model

    with one_rank_grid(tmp_path_factory.mktemp("pg")):
        set_seed(0)
        path = str(tmp_path_factory.mktemp("qwen3_moe"))
        make_family_model(path, "qwen3_moe", num_layers=2)
        yield path


@pytest.fixture(scope="module")
def moe(moe_path):
    from transformers import AutoConfig

    from parallel.distributed import set_seed
    from parallel.models import build_model_chunks

    set_seed(0)
    return build_model_chunks(AutoConfig.from_pretrained(moe_path), "actor", moe_path, moe_enable_routing_replay=True)


def _batch(seed=0, B=3, S=10, vocab=1000):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (B, S), generator=g)
    am = torch.ones_like(ids)
    am[0, :3] = 0  # left-padded prompt
    am[2, -2:] = 0  # right-padded response
    ids = torch.where(am.bool(), ids, torch.full_like(ids, 3))
    return dict(input_ids=ids, attention_mask=am, position_ids=(am.cumsum(1) - 1).clamp(min=0))


def _fb(bundle, batch, routing, **kw):
    from parallel.forward import forward_backward

    with torch.no_grad():
        return forward_backward(bundle.chunks, batch, kind="log_probs", vocab_size=bundle.spec.vocab_size,
                                micro_batch_size=1, routing=routing, **kw)


def test_replay_uses_exactly_the_given_experts_and_own_routing_changes_nothing(moe):
    from parallel.router_replay import RoutingReplay

    rr = RoutingReplay(moe.chunks)
    try:
        batch = _batch()
        mask = batch["attention_mask"].bool()
        own = _fb(moe, batch, rr, record_routing=True)
        R = own["routed_experts"]
        assert R.shape == (3, 10, 2, 2) and R.dtype == torch.int16
        assert ((R >= 0) & (R < 8)).all()
        # replaying the model's own routing: identical log-probs (same experts, same gate weights)
        again = _fb(moe, {**batch, "routed_experts": R}, rr, record_routing=True)
        assert torch.equal(again["routed_experts"], R)
        assert (again["log_probs"] - own["log_probs"]).abs().max().item() <= 1e-6
        # replaying random experts: the routers use them, token by token, layer by layer (also padding)
        g = torch.Generator().manual_seed(1)
        G = torch.rand(3, 10, 2, 8, generator=g).argsort(-1)[..., :2].sort(-1).values
        rep = _fb(moe, {**batch, "routed_experts": G}, rr, record_routing=True)
        assert torch.equal(rep["routed_experts"], G)
        assert routing_agreement(rep["routed_experts"], G, mask) == (float(mask.sum() * 2),) * 2
        a, n = routing_agreement(R, G, mask)
        assert n == float(mask.sum() * 2) and a < n
        diff = (rep["log_probs"] - own["log_probs"]).abs()[mask]
        assert diff.max().item() > 1e-3  # other experts, other log-probs
        # after the call the routers route on their own again
        assert torch.equal(_fb(moe, batch, rr, record_routing=True)["routed_experts"], R)
        # a training pass replays too: gradients flow through the gate at the replayed experts
        from parallel.forward import forward_backward

        seen = []

        def loss_fn(outs, mb):
            seen.append(outs["log_probs"].detach())
            return -outs["log_probs"].sum(), {}

        for c in moe.chunks:
            c.zero_grad_buffer() if hasattr(c, "zero_grad_buffer") else c.zero_grad()
        forward_backward(moe.chunks, {**batch, "routed_experts": G}, kind="log_probs",
                         vocab_size=moe.spec.vocab_size, micro_batch_size=1, loss_fn=loss_fn, forward_only=False,
                         routing=rr)
        assert (torch.cat(seen, 0) - rep["log_probs"]).abs()[mask].max().item() <= 1e-5
    finally:
        rr.close()


def test_odd_length_padding_and_no_moe_errors(moe):
    from parallel.router_replay import RoutingReplay

    rr = RoutingReplay(moe.chunks)
    try:
        batch = {k: v[:, :7] for k, v in _batch(seed=3).items()}
        out = _fb(moe, batch, rr, record_routing=True, seq_length_multiple=4)  # padded to 8 inside
        assert out["routed_experts"].shape == (3, 7, 2, 2)
        rep = _fb(moe, {**batch, "routed_experts": out["routed_experts"]}, rr, record_routing=True,
                  seq_length_multiple=4)
        assert torch.equal(rep["routed_experts"], out["routed_experts"])
    finally:
        rr.close()


def test_full_recompute_replays_in_the_backward_too(moe, tmp_path):
    """Under full recompute the backward's recomputed routers replay too (megatron's REPLAY_BACKWARD queue): the
    gradients equal those of the same replayed pass without recompute.  (Without a pipeline each backward follows
    its own forward; the queue's order under 1F1B is checked at PP2 in tests/support/dist/router_replay_checks.py.)"""
    from transformers import AutoConfig

    from parallel.distributed import set_seed
    from parallel.forward import forward_backward
    from parallel.models import build_model_chunks
    from parallel.router_replay import RoutingReplay
    from tests.support.model_families import make_family_model

    path = str(tmp_path / "m")
    make_family_model(path, "qwen3_moe", num_layers=2)
    batch = _batch(seed=4)
    g = torch.Generator().manual_seed(2)
    G = torch.rand(3, 10, 2, 8, generator=g).argsort(-1)[..., :2]
    grads = {}
    for recompute in (None, "full"):
        set_seed(0)
        b = build_model_chunks(AutoConfig.from_pretrained(path), "actor", path, moe_enable_routing_replay=True,
                               recompute=recompute)
        rr = RoutingReplay(b.chunks)
        try:
            forward_backward(b.chunks, {**batch, "routed_experts": G}, kind="log_probs", vocab_size=b.spec.vocab_size,
                             micro_batch_size=1, forward_only=False, routing=rr,
                             loss_fn=lambda outs, mb: (-outs["log_probs"].sum(), {}))
        finally:
            rr.close()
        grads[recompute] = {n: (p.main_grad if getattr(p, "main_grad", None) is not None else p.grad).clone()
                            for n, p in b.chunks[0].named_parameters() if "router" in n or "experts" in n}
    assert grads[None].keys() == grads["full"].keys() and grads[None]
    worst = max((grads[None][n] - grads["full"][n]).abs().max().item() for n in grads[None])
    assert worst <= 1e-6, worst


def test_actor_routing_under_dynamic_batching_equals_padded(moe):
    """MegatronActor.compute_log_prob with routing (R2 records, R3 replays the batch's): with dynamic batching (rows
    compacted into token-budget micro batches, rlhf.workers.dynamic_batch) the recorded routing, the replay and the
    log-probs equal the padded micro batches' (real tokens), and moe/routing_agreement is 1.0 under R3."""
    from rlhf.config import compose_config
    from rlhf.workers.actor import MegatronActor

    batch = _batch(seed=6)
    batch["responses"] = batch["input_ids"][:, -4:]
    mask = batch["attention_mask"].bool()
    padded_cfg = compose_config(["actor.log_prob_micro_batch_size_per_gpu=3"]).actor
    dyn_cfg = compose_config(["actor.use_dynamic_bsz=true", "actor.log_prob_max_token_len_per_gpu=20"]).actor
    out = {}
    for name, cfg in (("padded", padded_cfg), ("dynamic", dyn_cfg)):
        actor = MegatronActor(moe, None, cfg, router_replay="R2")
        try:
            r2 = actor.compute_log_prob(batch)
            actor.router_replay = "R3"
            g = torch.Generator().manual_seed(3)
            G = torch.rand(3, 10, 2, 8, generator=g).argsort(-1)[..., :2]
            r3 = actor.compute_log_prob({**batch, "routed_experts": G, "routed_experts_mask": mask})
        finally:
            actor.routing.close()
        out[name] = (r2, r3)
    (p2, p3), (d2, d3) = out["padded"], out["dynamic"]
    assert torch.equal(d2["routed_experts"][mask], p2["routed_experts"][mask])
    assert (d2["log_probs"] - p2["log_probs"]).abs().max().item() <= 1e-5
    assert d3["metrics"] == p3["metrics"] == {"moe/routing_agreement": 1.0}
    assert (d3["log_probs"] - p3["log_probs"]).abs().max().item() <= 1e-5
    assert (d3["log_probs"] - d2["log_probs"]).abs().max().item() > 1e-3  # the replay changed them


def _replay_cfg(*extra):
    from rlhf.config import compose_config

    return compose_config(["actor.router_replay.mode=R3", "rollout.enable_rollout_routing_replay=true",
                           "model.dtype=float32", "actor.log_prob_micro_batch_size_per_gpu=3", *extra])


def _r3_batch(seed=7):
    """A batch with `responses`, the response layout the workers need, and engine routing G [3, 10, 2, 2] that
    differs from the model's own."""
    batch = _batch(seed=seed)
    batch["responses"] = batch["input_ids"][:, -4:]
    batch["prompt_length"] = 6
    batch["response_mask"] = batch["attention_mask"][:, -4:]
    g = torch.Generator().manual_seed(seed)
    batch["routed_experts"] = torch.rand(3, 10, 2, 8, generator=g).argsort(-1)[..., :2].to(torch.int16)
    batch["routed_experts_mask"] = batch["attention_mask"].bool()
    return batch


def test_reference_and_critic_route_on_their_own_under_r3_as_verl(moe, moe_path):
    """verl replays routing only in the actor's forwards: compute_ref_log_prob (verl/workers/megatron_workers.py)
    sets no RouterReplay action, so a separate reference routes on its own under R2 and R3; its critic has no
    routing replay.  Here: build_reference / build_critic under R3 build no replay, the reference's log-probs equal
    the unreplayed forward of the same weights exactly and differ from the actor's replayed ones; the critic's values
    do not depend on the batch's routing."""
    from transformers import AutoConfig

    from rlhf.workers.actor import MegatronActor
    from rlhf.workers.build import build_critic, build_reference

    cfg, batch = _replay_cfg(), _r3_batch()
    hf = AutoConfig.from_pretrained(moe_path)
    ref = build_reference(cfg, hf, moe_path, temperature=1.0)
    assert ref.routing is None and not getattr(ref.bundle.config, "moe_enable_routing_replay", False)
    got = ref.compute_log_prob(batch)
    assert set(got) == {"log_probs"}  # no routing, no moe/routing_agreement
    actor = MegatronActor(moe, None, cfg.actor, router_replay="R3")  # the same HF weights, built for replay
    try:
        replayed = actor.compute_log_prob(batch)
        actor.router_replay = "disabled"
        own = actor.compute_log_prob(batch)
    finally:
        actor.routing.close()
    assert replayed["metrics"] == {"moe/routing_agreement": 1.0}
    assert own["metrics"]["moe/routing_agreement"] < 1.0  # the engine routing differs from the model's
    assert torch.equal(got["log_probs"], own["log_probs"])
    assert (got["log_probs"] - replayed["log_probs"]).abs().max().item() > 1e-3

    critic = build_critic(cfg, moe_path)
    assert not getattr(critic.bundle.config, "moe_enable_routing_replay", False)
    other = {**batch, "routed_experts": torch.flip(batch["routed_experts"], [0])}
    assert torch.equal(critic.compute_values(batch), critic.compute_values(other))


def test_lora_reference_replays_the_engine_routing_under_r3_as_verl(moe_path):
    """With LoRA the reference is the actor with its adapters off (verl: compute_ref_log_prob -> compute_log_prob
    with is_lora, which sets REPLAY_FORWARD under R3 and RECORD under R2).  At step 0 (B = 0) its log-probs under R3
    equal the actor's replayed ones exactly and differ from the unreplayed forward; under R2 it records, so its
    log-probs are the unreplayed ones."""
    from transformers import AutoConfig

    from rlhf.workers.build import build_actor, build_reference
    from rlhf.workers.lora_reference import AdapterOffReference

    cfg, batch = _replay_cfg("model.lora.rank=2", "model.lora.target_modules=[linear_qkv,linear_proj]"), _r3_batch(seed=8)
    hf = AutoConfig.from_pretrained(moe_path)
    actor = build_actor(cfg, hf, moe_path, temperature=1.0)
    try:
        ref = build_reference(cfg, hf, moe_path, temperature=1.0, actor=actor)
        assert isinstance(ref, AdapterOffReference)
        replayed = actor.compute_log_prob(batch)["log_probs"]
        got = ref.compute_log_prob(batch)
        assert torch.equal(got["log_probs"], replayed)
        assert got["metrics"] == {"moe/routing_agreement": 1.0}
        actor.router_replay = "R2"
        r2 = ref.compute_log_prob(batch)["log_probs"]
        actor.router_replay = "disabled"
        own = ref.compute_log_prob(batch)["log_probs"]
        assert torch.equal(r2, own)
        assert (got["log_probs"] - own).abs().max().item() > 1e-3
    finally:
        actor.routing.close()
