"""RolloutManager over Ray on CPU: batch split, engine crash mid-rollout -> restart with latest weights -> retry.

Two engines start in parallel (one shared manager for the module) and one restart happens: ~1.5-2 min.
"""

import os
import signal
import threading
import time

import pytest
import torch

from rlhf.rollout.ray_engines import RolloutManager, _split
from rlhf.rollout.sampling import SamplingConfig, stop_token_ids_for
from tests.helpers.tiny_models import make_tiny_hf_model
from tests.helpers.tiny_tokenizer import make_tiny_tokenizer


def test_split_is_contiguous_and_balanced():
    assert _split(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert _split(2, 4) == [(0, 1), (1, 2)]
    assert _split(0, 2) == []


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    owned = not ray.is_initialized()  # reuse a session another module started
    if owned:
        ray.init(num_cpus=2, include_dashboard=False)
    yield ray
    if owned:
        ray.shutdown()


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
                                             max_total_tokens=16384),
                         placement="colocated", max_restarts=2, retain_latest_weights=True)
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
    with pytest.raises(ValueError, match="placement"):
        RolloutManager(1, dict(model_path=path), placement="nearby", start=False)
    with pytest.raises(ValueError, match="num_engines"):
        RolloutManager(0, dict(model_path=path), start=False)
    with pytest.raises(ValueError, match="model_path"):
        RolloutManager(1, dict(tp_size=1), start=False)
    # disaggregated engines stay resident: release/resume are no-ops (no engine is even started here)
    mgr = RolloutManager(1, dict(model_path=path), placement="disaggregated", start=False)
    mgr.release_memory_occupation()
    mgr.resume_memory_occupation()
    mgr.shutdown()


@pytest.mark.slow
@pytest.mark.sglang
def test_engine_killed_mid_rollout_is_restarted_with_latest_weights(manager, tiny_model):
    from safetensors.torch import load_file

    path, tok = tiny_model
    stop = stop_token_ids_for(path)
    # latest weights: perturbed, pushed through the manager (retained for restarts)
    g = torch.Generator().manual_seed(7)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g)
           for k, v in load_file(os.path.join(path, "model.safetensors")).items()}
    manager.update_weights_from_tensor(list(new.items()))
    assert manager.weight_versions() == [1, 1]

    texts = [f"Tom has {i} apples and buys {i + 3} more. How many apples does Tom have?" for i in range(24)]
    prompts = [tok(t).input_ids for t in texts]
    cfg = SamplingConfig(n=2, temperature=0.0, max_new_tokens=256, stop_token_ids=stop)
    # a rollout long enough (24 prompts x 2 samples x up to 256 tokens, several seconds) for the kill to land
    # while it runs
    pids = manager.engine_pids()
    box = {}

    def run():
        t0 = time.time()
        box["samples"] = manager.generate(prompts, cfg)
        box["seconds"] = time.time() - t0

    th = threading.Thread(target=run)
    th.start()
    time.sleep(1.0)
    in_flight = th.is_alive()
    os.kill(pids[0], signal.SIGKILL)
    th.join(timeout=400)
    assert not th.is_alive(), "rollout did not finish after the engine was killed"
    assert in_flight, "the rollout finished before the kill; make it longer"
    print(f"\n[rollout-ray] rollout with one engine killed: {box['seconds']:.1f} s; restarts "
          f"{manager.restart_log}")
    assert manager.num_restarts == 1
    new_pids = manager.engine_pids()
    assert new_pids[0] != pids[0] and new_pids[1] == pids[1]
    samples = box["samples"]
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(i, j) for i in range(24) for j in range(2)]
    for s in samples:
        assert s.prompt_ids == prompts[s.prompt_index]
        assert len(s.response_log_probs) == len(s.response_ids) > 0
        assert s.weight_version == 1  # the restarted engine got the latest weights back
    # restarted engine (prompts 0..11) and surviving engine (12..23) both produce HF's greedy output
    # under the pushed weights
    for i in (0, 11, 12, 23):
        ref = hf_greedy(path, new, prompts[i], 256, stop)
        got = [s.response_ids for s in samples if s.prompt_index == i]
        assert got == [ref] * 2, f"prompt {i}"


@pytest.mark.slow
@pytest.mark.sglang
def test_colocated_release_resume(manager, tiny_model):
    path, tok = tiny_model
    prompts = [tok("How many pens does Sam have?").input_ids, tok("3+4=7").input_ids]
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=8)
    before = [s.response_ids for s in manager.generate(prompts, cfg)]
    manager.release_memory_occupation()
    with pytest.raises(RuntimeError, match="released"):
        manager.generate(prompts, cfg)
    manager.resume_memory_occupation()
    assert [s.response_ids for s in manager.generate(prompts, cfg)] == before
