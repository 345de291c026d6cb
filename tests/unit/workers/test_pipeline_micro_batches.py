"""Under virtual pipeline stages megatron's interleaved schedule needs a number of micro
batches that is a multiple of PP.  The workers choose micro batch sizes that satisfy it (the no-grad forward
pads a slice that cannot split), and the trainers refuse batch sizes that cannot, at start, with the fix.
Fast (megatron stubbed); tests/e2e/test_pipeline_vpp.py runs the real schedule at PP2 x VPP2."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlhf.workers import worker as worker_mod
from rlhf.workers.batch import check_micro_batch_layout, micro_batch_size
from rlhf.workers.worker import MegatronWorker


@pytest.mark.parametrize("n_local,requested,group,multiple,expected", [
    (4, 4, 1, 2, 2),  # 4 rows, PP 2: micro batches of 2 (2 of them), not one of 4
    (8, 8, 1, 2, 4), (8, 3, 1, 2, 2), (6, 4, 1, 2, 3), (6, 8, 1, 3, 2), (2, 8, 1, 2, 1),
    (8, 8, 2, 2, 4), (8, 2, 2, 2, 2), (12, 8, 2, 2, 6), (4, 4, 2, 2, 2),
    (8, 4, 1, 1, 4), (7, 4, 1, 1, 1),  # no virtual pipeline: unchanged
])
def test_micro_batch_size_gives_a_multiple_of_pp_micro_batches(n_local, requested, group, multiple, expected):
    mbs = micro_batch_size(n_local, requested, group, multiple_of=multiple)
    assert mbs == expected
    assert n_local % mbs == 0 and (n_local // mbs) % multiple == 0 and mbs % group == 0


def test_micro_batch_size_refuses_what_cannot_split():
    with pytest.raises(ValueError, match="3 sequences per data-parallel rank .* multiple of 2 micro batches"):
        micro_batch_size(3, 4, 1, multiple_of=2)
    with pytest.raises(ValueError, match=r"groups of 2\) .* multiple of 4"):
        micro_batch_size(6, 4, 2, multiple_of=2)


def test_check_micro_batch_layout_names_every_bad_batch_and_the_fix():
    rows = {"data.train_batch_size x rollout.n": 12, "actor.ppo_mini_batch_size x rollout.n": 6}
    check_micro_batch_layout(rows, dp_size=2, multiple=1)  # no virtual pipeline: nothing to check
    check_micro_batch_layout(rows, dp_size=1, multiple=2)  # 12 and 6 rows: even
    with pytest.raises(ValueError) as e:
        check_micro_batch_layout(rows, dp_size=2, multiple=2)  # 6 and 3 rows per rank
    msg = str(e.value)
    assert "actor.ppo_mini_batch_size x rollout.n = 6 sequences, 3 per data-parallel rank" in msg
    assert "data.train_batch_size x rollout.n" not in msg  # 12 rows: 6 per rank, fine
    assert "multiple of the pipeline size 2" in msg and "unset parallel.virtual_pipeline_model_parallel_size" in msg
    with pytest.raises(ValueError, match="multiple of 4 sequences per data-parallel rank"):
        check_micro_batch_layout({"actor.ppo_mini_batch_size pairs x 2": 6}, dp_size=1, multiple=2, group=2)


@pytest.fixture
def pp2(monkeypatch):
    """MegatronWorker with the pipeline multiple 2 and megatron's forward recorded."""
    calls = []
    monkeypatch.setattr(worker_mod, "pipeline_micro_batch_multiple", lambda: 2)
    monkeypatch.setattr(worker_mod, "dp_info", lambda: (0, 1, None))

    def forward_backward(model, mb, *, micro_batch_size, forward_only=True, loss_fn=None, **kw):
        n = mb["input_ids"].shape[0]
        assert (n // micro_batch_size) % 2 == 0, "the interleaved schedule would raise"
        calls.append((mb["input_ids"][:, 0].tolist(), micro_batch_size, mb.get("global_info")))
        if forward_only:  # a forward (outputs); an update returns per-micro-batch metrics
            return {"log_probs": mb["input_ids"].float() * 10}
        return [{}]

    monkeypatch.setattr(worker_mod, "forward_backward", forward_backward)
    monkeypatch.setattr(worker_mod, "zero_grads", lambda state: None)
    monkeypatch.setattr(worker_mod, "optimizer_step", lambda state: None)
    return calls


def test_forward_pads_an_odd_slice_and_drops_the_padding(pp2):
    """3 rows with PP 2: forwarded as 4 (the last row repeated), micro batches of 2; the 3 real rows come back."""
    w = MegatronWorker(SimpleNamespace(chunks=None), forward_micro_batch_size=8)
    batch = {"input_ids": torch.tensor([[5, 1], [6, 1], [7, 1]]), "attention_mask": torch.ones(3, 2),
             "position_ids": torch.zeros(3, 2)}
    out = w.forward(batch)
    assert pp2 == [([5, 6, 7, 7], 2, None)]
    assert out["log_probs"].tolist() == [[50, 10], [60, 10], [70, 10]]


def test_update_loop_uses_a_multiple_of_pp_micro_batches(pp2):
    """4 rows per mini batch, micro batch 4 requested: 2 micro batches of 2; num_micro_batches tells the loss."""
    w = MegatronWorker(None, state=SimpleNamespace(model=None), forward_micro_batch_size=8)
    batch = {"input_ids": torch.arange(8).view(8, 1), "attention_mask": torch.ones(8, 1),
             "position_ids": torch.zeros(8, 1), "n": 1}
    w.train_mini_batches(batch, ("input_ids", "attention_mask", "position_ids"), None, mini_batch_size=4,
                         micro_batch_size_per_gpu=4, epochs=1, step=1)
    assert [(rows, mbs, info["num_micro_batches"]) for rows, mbs, info in pp2] == [([0, 1, 2, 3], 2, 2),
                                                                                    ([4, 5, 6, 7], 2, 2)]
