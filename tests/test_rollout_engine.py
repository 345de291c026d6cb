"""RolloutEngine (SGLang in a child process) against Hugging Face on a tiny random Llama, on CPU.

Engine starts cost 25-60 s each on 2 cores, so one tp=1 engine is shared by the module (tests that change its
weights restore them) and the test that kills it runs last; one tp=2 engine is started for a single check.
"""

import os
import socket
import threading
import time

import pytest
import torch

from rlhf.rollout.engine import EngineCallError, EngineDiedError, RolloutEngine, read_checkpoint_weights
from rlhf.rollout.sampling import SamplingConfig, stop_token_ids_for
from tests.helpers.tiny_models import make_tiny_hf_model
from tests.helpers.tiny_tokenizer import make_tiny_tokenizer

slow_sglang = [pytest.mark.slow, pytest.mark.sglang]

PROMPT_TEXTS = [
    "Tom has 3 apples and buys 4 more.",
    "How many clips did Natalia sell?",
    "3+4=7 5-2=3",
]


# ---------------------------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    tok = make_tiny_tokenizer()
    path = str(tmp_path_factory.mktemp("tiny_llama"))
    make_tiny_hf_model(path, "llama_gqa", vocab_size=len(tok), num_layers=2, tokenizer=tok)
    prompts = [tok(t).input_ids for t in PROMPT_TEXTS]
    return path, tok, prompts


@pytest.fixture(scope="module")
def engine(tiny_model):
    path, _, _ = tiny_model
    t0 = time.time()
    eng = RolloutEngine(path, tp_size=1, dtype="float32", context_length=256, random_seed=0)
    print(f"\n[rollout] tp=1 engine start-up: {time.time() - t0:.1f} s")
    yield eng
    eng.shutdown()


def load_state(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def perturbed_state(path, seed=1, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in load_state(path).items()}


def hf_model(path, state=None):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if state is not None:
        missing, unexpected = m.load_state_dict(state, strict=False)
        assert not unexpected
    return m.eval()


def hf_greedy(model, prompt, max_new_tokens, stop_ids):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=list(stop_ids),
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_token_log_probs(model, prompt, response, temperature=1.0):
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return lp.gather(-1, torch.tensor(response)[:, None])[:, 0]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------- no engine
def test_stop_token_ids_collects_every_source(tiny_model, tmp_path):
    path, tok, _ = tiny_model
    assert stop_token_ids_for(path) == [2]  # tokenizer eos <|im_end|> == config / generation_config eos 2
    import json
    import shutil

    d = tmp_path / "m"
    shutil.copytree(path, d)
    gc = json.loads((d / "generation_config.json").read_text())
    gc["eos_token_id"] = [2, 3, 7]
    (d / "generation_config.json").write_text(json.dumps(gc))
    assert stop_token_ids_for(str(d), extra=[11, 3]) == [2, 3, 7, 11]
    tok2 = make_tiny_tokenizer()
    tok2.save_pretrained(str(d))
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(str(d))
    assert stop_token_ids_for(loaded) == [2, 3, 7]  # tokenizer object: finds its directory via name_or_path
    assert stop_token_ids_for(tok2) == [2]  # in-memory tokenizer: only its eos
    cfg = SamplingConfig(stop_token_ids=[5]).with_stop_ids_from(str(d), extra=[9])
    assert cfg.stop_token_ids == [2, 3, 5, 7, 9]
    with pytest.raises(ValueError, match="extra ids"):
        stop_token_ids_for(str(d), extra=[-1])


def test_sampling_config_validation_and_params():
    with pytest.raises(ValueError, match="n must"):
        SamplingConfig(n=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingConfig(top_k=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=-1.0)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingConfig(stop_token_ids=[1, -2])
    p = SamplingConfig(n=3, temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=5, stop_token_ids=[4, 2, 4]).to_sglang(11)
    assert p == dict(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=5, stop_token_ids=[2, 4], sampling_seed=11)


def test_expected_weights_from_checkpoint_headers(tiny_model):
    path, _, _ = tiny_model
    w = read_checkpoint_weights(path)
    sd = load_state(path)
    assert set(w) == set(sd)
    for k, v in sd.items():
        assert w[k] == (tuple(v.shape), v.dtype)
    eng = RolloutEngine(path, dtype="bfloat16", start=False)
    assert eng.expected_weights()["model.norm.weight"] == ((64,), torch.bfloat16)
    with pytest.raises(EngineDiedError):
        eng.generate([[1, 2]], SamplingConfig())
    with pytest.raises(ValueError, match="wrong shapes.*q_proj"):
        eng.validate_named_tensors(["model.layers.0.self_attn.q_proj.weight"], [(64, 10)])
    with pytest.raises(ValueError, match="unknown weight names.*bogus"):
        eng.validate_named_tensors(["model.bogus.weight"], [(1,)])
    with pytest.raises(ValueError, match="tp_size"):
        RolloutEngine(path, tp_size=0, start=False)
    with pytest.raises(ValueError, match="not a HF model directory"):
        RolloutEngine(os.path.dirname(path), start=False)


# ---------------------------------------------------------------------------------------------- tp = 1
@pytest.mark.slow
@pytest.mark.sglang
def test_greedy_matches_hf_with_stop_ids_and_log_probs(engine, tiny_model):
    path, _, prompts = tiny_model
    model = hf_model(path)
    base_stop = stop_token_ids_for(path)
    # an extra stop id that greedy decoding of prompt 0 reaches mid-way, so "stop" is exercised
    first = hf_greedy(model, prompts[0], 12, base_stop)
    stop = sorted(set(base_stop + [first[4]]))
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=12, stop_token_ids=stop)
    t0 = time.time()
    samples = engine.generate(prompts, cfg)
    print(f"\n[rollout] greedy 3 prompts x 12 tokens: {time.time() - t0:.2f} s")
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(0, 0), (1, 0), (2, 0)]
    reasons = []
    for s, p in zip(samples, prompts):
        assert s.prompt_ids == p
        ref = hf_greedy(model, p, 12, stop)
        assert s.response_ids == ref, (s.response_ids, ref)
        if s.finish_reason == "stop":
            assert s.response_ids[-1] in stop and not set(s.response_ids[:-1]) & set(stop)
        else:
            assert s.finish_reason == "length" and len(s.response_ids) == 12
        reasons.append(s.finish_reason)
        lp = torch.tensor(s.response_log_probs)
        ref_lp = hf_token_log_probs(model, p, s.response_ids)
        assert lp.shape == ref_lp.shape
        torch.testing.assert_close(lp, ref_lp, atol=1e-4, rtol=0)
    assert reasons[0] == "stop" and len(samples[0].response_ids) <= 5


@pytest.mark.slow
@pytest.mark.sglang
def test_sampling_n_samples_stop_ids_and_log_probs(engine, tiny_model):
    path, _, prompts = tiny_model
    model = hf_model(path)
    stop = sorted(set(stop_token_ids_for(path) + list(range(100, 140))))  # ~10% of the vocabulary stops
    cfg = SamplingConfig(n=4, temperature=0.8, top_p=1.0, top_k=-1, max_new_tokens=16, stop_token_ids=stop, seed=5)
    samples = engine.generate(prompts, cfg)
    assert len(samples) == 12
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(i, j) for i in range(3) for j in range(4)]
    for s in samples:
        assert s.prompt_ids == prompts[s.prompt_index]
        assert 1 <= len(s.response_ids) <= 16 and len(s.response_log_probs) == len(s.response_ids)
        hits = [t for t in s.response_ids if t in stop]
        if s.finish_reason == "stop":
            assert hits == [s.response_ids[-1]]
        else:
            assert s.finish_reason == "length" and len(s.response_ids) == 16 and not hits
        # log-probs are log_softmax(logits / T) of the sampled token
        ref = hf_token_log_probs(model, s.prompt_ids, s.response_ids, temperature=0.8)
        torch.testing.assert_close(torch.tensor(s.response_log_probs), ref, atol=1e-4, rtol=0)
    assert any(s.finish_reason == "stop" for s in samples)
    for i in range(3):  # samples of one prompt differ
        assert len({tuple(s.response_ids) for s in samples if s.prompt_index == i}) > 1
    # top-k restricts the support: with k=1 sampling is greedy
    g = engine.generate(prompts[:1], SamplingConfig(n=2, temperature=1.0, top_k=1, max_new_tokens=8))
    greedy = engine.generate(prompts[:1], SamplingConfig(temperature=0.0, max_new_tokens=8))
    assert g[0].response_ids == g[1].response_ids == greedy[0].response_ids


@pytest.mark.slow
@pytest.mark.sglang
def test_update_weights_from_tensor_matches_hf_with_new_weights(engine, tiny_model):
    path, _, prompts = tiny_model
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=10)
    before = [s.response_ids for s in engine.generate(prompts, cfg)]
    new = perturbed_state(path)
    v0 = engine.weight_version
    t0 = time.time()
    engine.update_weights_from_tensor(list(new.items()))
    print(f"\n[rollout] update_weights_from_tensor (full model): {time.time() - t0:.2f} s")
    assert engine.weight_version == v0 + 1
    after = engine.generate(prompts, cfg)
    model = hf_model(path, new)
    for s, p in zip(after, prompts):
        assert s.response_ids == hf_greedy(model, p, 10, stop_token_ids_for(path)), "engine output != HF with the pushed weights"
        torch.testing.assert_close(torch.tensor(s.response_log_probs), hf_token_log_probs(model, p, s.response_ids),
                                   atol=1e-4, rtol=0)
    assert [s.response_ids for s in after] != before
    # the loader fused q/k/v: SGLang's qkv_proj == cat(q, k, v) of what we sent
    qkv = engine.get_weights_by_name("model.layers.0.self_attn.qkv_proj.weight")
    ref = torch.cat([new[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv"])
    torch.testing.assert_close(qkv, ref)
    # inside an explicit session, in two chunks
    orig = load_state(path)
    names = sorted(orig)
    engine.begin_weight_update()
    engine.update_weights_from_tensor([(n, orig[n]) for n in names[: len(names) // 2]], flush_cache=False)
    engine.update_weights_from_tensor([(n, orig[n]) for n in names[len(names) // 2:]])
    engine.end_weight_update()
    assert [s.response_ids for s in engine.generate(prompts, cfg)] == before


@pytest.mark.slow
@pytest.mark.sglang
def test_validation_rejects_bad_updates_and_engine_survives(engine, tiny_model):
    _, _, prompts = tiny_model
    q = torch.zeros(64, 10)
    with pytest.raises(ValueError, match="wrong shapes"):
        engine.update_weights_from_tensor([("model.layers.0.self_attn.q_proj.weight", q)])
    with pytest.raises(ValueError, match="unknown weight names"):
        engine.update_weights_from_tensor([("model.layers.0.self_attn.qkv_proj.weight", torch.zeros(128, 64))])
    with pytest.raises(ValueError, match="between begin_weight_update"):
        engine.update_weights_from_distributed_async(["model.norm.weight"], ["float32"], [[64]], "g")
    with pytest.raises(EngineCallError):
        engine.get_weights_by_name("model.no_such.weight")
    assert engine.is_alive()
    assert len(engine.generate(prompts[:1], SamplingConfig(temperature=0.0, max_new_tokens=2))) == 1


@pytest.mark.slow
@pytest.mark.sglang
def test_update_weights_from_distributed_gloo_broadcast(engine, tiny_model):
    """The trainer (this process, rank 0) broadcasts weights over gloo while the engine receives."""
    from sglang.srt.utils.common import init_custom_process_group
    import torch.distributed as dist

    path, _, prompts = tiny_model
    port = free_port()
    handle = engine.init_weights_update_group_async("127.0.0.1", port, rank_offset=1, world_size=2,
                                                    group_name="rollout_sync", backend="gloo")
    pg = init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=0,
                                   group_name="rollout_sync")
    handle.wait(timeout=120)
    new = perturbed_state(path, seed=2)
    names = sorted(new)
    engine.begin_weight_update()
    h = engine.update_weights_from_distributed_async(names, [new[n].dtype for n in names],
                                                     [list(new[n].shape) for n in names], "rollout_sync")
    for n in names:
        dist.broadcast(new[n], src=0, group=pg)
    h.wait(timeout=120)
    engine.end_weight_update()
    model = hf_model(path, new)
    out = engine.generate(prompts, SamplingConfig(temperature=0.0, max_new_tokens=8))
    for s, p in zip(out, prompts):
        assert s.response_ids == hf_greedy(model, p, 8, stop_token_ids_for(path))
    engine.destroy_weights_update_group("rollout_sync")
    dist.destroy_process_group(pg)
    engine.update_weights_from_disk(path)  # back to the checkpoint for later tests
    orig = hf_model(path)
    out = engine.generate(prompts[:1], SamplingConfig(temperature=0.0, max_new_tokens=8))
    assert out[0].response_ids == hf_greedy(orig, prompts[0], 8, stop_token_ids_for(path))


@pytest.mark.slow
@pytest.mark.sglang
def test_release_and_resume_memory_keep_weights(engine, tiny_model):
    _, _, prompts = tiny_model
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=8)
    before = [s.response_ids for s in engine.generate(prompts, cfg)]
    engine.release_memory_occupation()
    engine.resume_memory_occupation()
    engine.flush_cache()
    assert [s.response_ids for s in engine.generate(prompts, cfg)] == before


@pytest.mark.slow
@pytest.mark.sglang
def test_wrong_shape_update_sent_directly_is_contained(engine, tiny_model):
    """SGLang kills its whole process tree on a wrong-shape load; only the engine child must die."""
    _, _, prompts = tiny_model
    pid = engine.pid
    engine.begin_weight_update()
    with pytest.raises((EngineDiedError, EngineCallError)):
        engine.update_weights_from_tensor([("model.layers.0.self_attn.q_proj.weight", torch.zeros(64, 10))],
                                          validate=False)
    deadline = time.time() + 60
    while engine.is_alive() and time.time() < deadline:  # the tree is torn down asynchronously
        try:
            engine.generate(prompts[:1], SamplingConfig(temperature=0.0, max_new_tokens=2))
        except EngineDiedError:
            break
        time.sleep(1)
    assert not engine.is_alive()
    with pytest.raises(EngineDiedError):
        engine.generate(prompts[:1], SamplingConfig(max_new_tokens=2))
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert threading.main_thread().is_alive()  # this (caller) process is fine


# ---------------------------------------------------------------------------------------------- tp = 2
@pytest.mark.slow
@pytest.mark.sglang
def test_tp2_greedy_matches_hf(tiny_model):
    path, _, prompts = tiny_model
    t0 = time.time()
    with RolloutEngine(path, tp_size=2, dtype="float32", context_length=256) as eng:
        print(f"\n[rollout] tp=2 engine start-up: {time.time() - t0:.1f} s")
        model = hf_model(path)
        out = eng.generate(prompts, SamplingConfig(temperature=0.0, max_new_tokens=10))
        for s, p in zip(out, prompts):
            assert s.response_ids == hf_greedy(model, p, 10, stop_token_ids_for(path))
            torch.testing.assert_close(torch.tensor(s.response_log_probs),
                                       hf_token_log_probs(model, p, s.response_ids), atol=1e-4, rtol=0)
        # full HF-named weights are sharded by the engine
        new = perturbed_state(path, seed=3)
        eng.update_weights_from_tensor(list(new.items()))
        model = hf_model(path, new)
        out = eng.generate(prompts[:2], SamplingConfig(temperature=0.0, max_new_tokens=8))
        for s, p in zip(out, prompts):
            assert s.response_ids == hf_greedy(model, p, 8, stop_token_ids_for(path))
