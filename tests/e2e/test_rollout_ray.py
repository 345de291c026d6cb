"""RolloutManager over Ray on CPU: generation split over engines, an engine killed mid-rollout is replaced and
(being stale) never generates until it got the latest weights again, every tensor of it compared after.

Two engines start in parallel (one shared manager for the module) and two replacements happen: ~2-5 min.
"""

import os
import signal
import threading
import time

import pytest
import torch

from rlhf.rollout.manager import RolloutManager, StaleEnginesError, split_evenly
from rlhf.rollout.sampling import SamplingConfig, stop_token_ids_for
from tests.support.fakes import push_weights
from tests.support.tiny_models import make_tiny_hf_model
from tests.support.tiny_tokenizer import make_tiny_tokenizer


def test_split_is_contiguous_and_balanced():
    assert split_evenly(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_evenly([4, 9], 4) == [[4], [9]]
    assert split_evenly([], 2) == []


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    tok = make_tiny_tokenizer()
    path = str(tmp_path_factory.mktemp("tiny_llama_ray"))
    make_tiny_hf_model(path, "llama_gqa", vocab_size=len(tok), num_layers=2, tokenizer=tok, seed=4)
    return path, tok


@pytest.fixture(scope="module")
def manager(ray_local, tiny_model):
    path, _ = tiny_model
    t0 = time.time()
    mgr = RolloutManager(2, dict(model_path=path, tp_size=1, dtype="float32", context_length=320,
                                 max_total_tokens=16384), placement="colocated", max_restarts=2)
    print(f"\n[rollout-ray] 2 engines started in parallel: {time.time() - t0:.1f} s "
          f"(per engine {[round(i['startup_seconds'], 1) for i in mgr.startup_info]})")
    yield mgr
    mgr.shutdown()


def hf_greedy(path, state, prompt, max_new_tokens, stop_ids):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    m.load_state_dict(state, strict=False)
    with torch.no_grad():
        out = m.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=list(stop_ids), pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_invalid_manager_arguments(ray_local, tiny_model):
    path, _ = tiny_model
    for kwargs, match in [(dict(num_engines=0), "num_engines"), (dict(placement="nowhere"), "placement"),
                          (dict(max_restarts=-1), "max_restarts")]:
        args = dict(num_engines=1, engine_config=dict(model_path=path), start=False)
        args.update(kwargs)
        with pytest.raises(ValueError, match=match):
            RolloutManager(**args)
    with pytest.raises(ValueError, match="not a HF model directory"):
        RolloutManager(1, dict(model_path=os.path.dirname(path)), start=False)


N_PROMPTS = 96  # prompts of the killed-engine rollouts


def kill_during(manager, engine, run):
    """Run ``run()`` in a thread and SIGKILL ``engine``'s actor while it runs; returns run's result or error."""
    pid = manager.engine_pids()[engine]
    box = {}

    def target():
        try:
            box["out"] = run()
        except BaseException as e:  # noqa: BLE001 - inspected by the test
            box["err"] = e

    th = threading.Thread(target=target)
    th.start()
    time.sleep(1.5)
    in_flight = th.is_alive()
    os.kill(pid, signal.SIGKILL)
    th.join(timeout=600)
    assert not th.is_alive(), "the call did not finish after the engine was killed"
    assert in_flight, "the call finished before the kill; make it longer"
    return box


def engine_weight(manager, engine, name):
    return torch.tensor(manager.get_weights_by_name(name, truncate_size=1 << 20, engines=[engine])[0])


def assert_engine_holds(manager, engine, state):
    """Every tensor of the engine equals ``state`` (SGLang fuses q/k/v and gate/up; TP 1 holds them whole)."""
    fused = {"self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                           "self_attn.v_proj.weight"),
             "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}
    parts = {p for group in fused.values() for p in group}
    layers = sorted({n.split(".")[2] for n in state if n.startswith("model.layers.")})
    for name, t in state.items():
        if not any(name.endswith(p) for p in parts):
            got = engine_weight(manager, engine, name)
            assert torch.equal(got[:t.shape[0]], t), name  # vocab rows are padded to a multiple of 64
            assert not got[t.shape[0]:].any(), name
    for i in layers:
        for fname, group in fused.items():
            want = torch.cat([state[f"model.layers.{i}.{p}"] for p in group])
            assert torch.equal(engine_weight(manager, engine, f"model.layers.{i}.{fname}"), want), (i, fname)


@pytest.mark.slow
@pytest.mark.sglang
def test_killed_engines_are_stale_until_resynced_with_every_tensor(manager, tiny_model):
    from safetensors.torch import load_file

    path, tok = tiny_model
    stop = stop_token_ids_for(path)
    g = torch.Generator().manual_seed(7)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g)
           for k, v in load_file(os.path.join(path, "model.safetensors")).items()}
    assert push_weights(manager, sorted(new.items()), bucket_bytes=20000) > 3  # a multi-bucket sync
    # enough requests that the rollout is still running when the kill comes 1.5 s in (with the CPU engine's
    # batched attention 24 prompts x 2 finished before it)
    texts = [f"Tom has {i} apples and buys {i + 3} more. How many apples does Tom have?" for i in range(N_PROMPTS)]
    prompts = [tok(t).input_ids for t in texts]
    cfg = SamplingConfig(n=2, temperature=0.0, max_new_tokens=256, stop_token_ids=stop)

    # 1. engine 1 dies mid-rollout: replaced, stale (it would serve the checkpoint), its prompts go to engine 0
    box = kill_during(manager, 1, lambda: manager.generate(prompts, cfg))
    assert "err" not in box, box.get("err")
    assert manager.restarts == [0, 1] and manager.stale_engines() == [1]
    samples = box["out"]
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(i, j) for i in range(N_PROMPTS) for j in range(2)]
    assert all(s.weight_version == 1 for s in samples)  # every sample came from an engine with the pushed weights
    for i in (0, N_PROMPTS // 2, N_PROMPTS - 1):
        assert [s.response_ids for s in samples if s.prompt_index == i] == [hf_greedy(path, new, prompts[i], 256,
                                                                                     stop)] * 2, f"prompt {i}"

    # 2. engine 0 dies too: no fresh engine is left, the rollout stops with what it has and what is left
    box = kill_during(manager, 0, lambda: manager.generate(prompts, cfg))
    err = box.get("err")
    assert isinstance(err, StaleEnginesError), box
    assert err.engines == [0, 1] and err.unfinished and manager.restarts == [1, 1]
    assert sorted(err.unfinished + sorted({s.prompt_index for s in err.samples})) == list(range(N_PROMPTS))

    # 3. the trainer re-syncs (multi-bucket): the restarted engines hold exactly the latest weights
    push_weights(manager, sorted(new.items()), bucket_bytes=20000)
    assert manager.stale_engines() == []
    for e in (0, 1):
        assert_engine_holds(manager, e, new)
    rest = manager.generate([prompts[i] for i in err.unfinished], cfg)
    for s in rest[::2][:3]:
        i = err.unfinished[s.prompt_index]
        assert s.response_ids == hf_greedy(path, new, prompts[i], 256, stop), f"prompt {i}"
