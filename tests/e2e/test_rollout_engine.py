"""SGLangEngine (a Ray actor owning sglang.Engine) behind a RolloutManager, against Hugging Face on a tiny
random Llama, on CPU.

Engine starts cost 30-100 s each on 2 cores, so one tp=1 engine is shared by the module (tests that change its
weights restore them) and the test that crashes it runs last.  A TP2 engine against HF (greedy ids and per-token
log-probs on its initial weights, then full HF-named weights pushed in several update_weights_from_tensor buckets,
one payload per engine TP rank) is checked on the weight-bridge e2e's engine B (tests/support/dist/bridge_e2e.py:
engine_B_initial_equals_hf, engine_B_initial_log_probs_equal_hf, pp2_B_step{1,2}_engine_equals_hf), which starts
that engine anyway.
"""

import os
import socket
import time

import pytest
import ray
import torch

from rlhf.rollout.engine_args import engine_kwargs, expected_weights_from_checkpoint
from rlhf.rollout.manager import RolloutManager, StaleEnginesError
from rlhf.rollout.sampling import SamplingConfig, stop_token_ids_for
from tests.support.fakes import push_weights
from tests.support.tiny_models import make_tiny_hf_model
from tests.support.tiny_tokenizer import make_tiny_tokenizer

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
def engine(ray_local, tiny_model):
    path, _, _ = tiny_model
    t0 = time.time()
    mgr = RolloutManager(1, dict(model_path=path, tp_size=1, dtype="float32", context_length=256, random_seed=0),
                         placement="colocated")
    print(f"\n[rollout] tp=1 engine start-up: {time.time() - t0:.1f} s")
    yield mgr
    mgr.shutdown()


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


def weight(mgr, name, rows=1 << 20):
    return torch.tensor(mgr.get_weights_by_name(name, truncate_size=rows)[0])


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


def test_expected_weights_and_engine_arguments(tiny_model):
    path, _, _ = tiny_model
    w = expected_weights_from_checkpoint(path, "float32")
    sd = load_state(path)
    assert set(w) == set(sd)
    for k, v in sd.items():
        assert w[k] == (tuple(v.shape), v.dtype)
    # "auto" is SGLang's rule: a float32 checkpoint runs in float16 (the bridge sends what the engine holds)
    assert {dt for _, dt in expected_weights_from_checkpoint(path).values()} == {torch.float16}
    assert expected_weights_from_checkpoint(path, "bfloat16")["model.norm.weight"] == ((64,), torch.bfloat16)
    kw = engine_kwargs(path, tp_size=2, dtype="float32", mem_fraction_static=0.4, device="cpu")
    assert kw["device"] == "cpu" and kw["attention_backend"] == "torch_native" and kw["tp_size"] == 2
    assert "mem_fraction_static" not in kw and "enable_memory_saver" not in kw  # CPU: no memory saver
    gpu = engine_kwargs(path, mem_fraction_static=0.4, device="cuda")
    assert gpu["enable_memory_saver"] is True and gpu["mem_fraction_static"] == 0.4
    with pytest.raises(ValueError, match="tp_size"):
        engine_kwargs(path, tp_size=0)
    with pytest.raises(ValueError, match="not a HF model directory"):
        engine_kwargs(os.path.dirname(path))
    with pytest.raises(ValueError, match="dtype"):
        engine_kwargs(path, dtype="int8")


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
def test_engine_process_tree_token_ids_only_and_every_core(engine):
    """skip_tokenizer_init: the scheduler answers the tokenizer manager itself, no detokenizer process is started;
    the CPU scheduler is forked from the engine actor (no spawn: no resource tracker, no second import of SGLang)
    and computes on every core of the machine (rlhf.rollout.sglang_cpu), not with Ray's one thread."""
    import psutil

    kids = psutil.Process(engine.engine_pids()[0]).children(recursive=True)
    titles = [" ".join(k.cmdline()) for k in kids]
    assert len(kids) == 1 and "detokenizer" not in titles[0] and "multiprocessing" not in titles[0], titles
    assert kids[0].environ()["OMP_NUM_THREADS"] == str(len(os.sched_getaffinity(0)))


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
def test_agent_loop_trains_the_engines_tokens_over_turns(engine, tiny_model):
    """The agent loop (rlhf/agent) over this engine, verl's Gsm8kInteraction answering every (wrong) model turn:
    over 3+ turns every trained model token is the engine's output id, each request continued from exactly the
    trained sequence so far, and HF's log-probs of the model tokens on the WHOLE trained sequence (tool / user tokens
    in between) equal the engine's."""
    from rlhf.agent.config import MultiTurnSettings
    from rlhf.agent.interactions import Gsm8kInteraction
    from rlhf.agent.loop import AgentLoop

    path, tok, _ = tiny_model
    calls = []

    def generate(prompts, sampling):
        out = engine.generate(prompts, sampling)
        calls.extend((list(p), list(s.response_ids), list(s.response_log_probs)) for p, s in zip(prompts, out))
        return out

    stop = sorted(set(stop_token_ids_for(path) + list(range(100, 180))))  # short model turns that end by a stop id
    agent = AgentLoop(MultiTurnSettings(enable=True, max_user_turns=3, max_tokens_per_turn=16), tok, 230,
                      interactions={"gsm8k": Gsm8kInteraction({"name": "gsm8k"})}, max_context=256)
    rows = [{"raw_prompt": [{"role": "user", "content": t}], "ground_truth": "123456",
             "extra_info": {"interaction_kwargs": {"name": "gsm8k", "ground_truth": "123456"}}} for t in PROMPT_TEXTS[:2]]
    samples, m = agent.run(generate, rows, SamplingConfig(n=2, temperature=0.8, max_new_tokens=16,
                                                          stop_token_ids=stop, seed=3))
    model = hf_model(path)
    assert m["multi_turn/waves"] >= 3
    for s in samples:
        spans, mask = s.extra["model_spans"], s.extra["response_mask"]
        assert len(spans) >= 3 or s.finish_reason == "length", (spans, s.finish_reason)
        assert len(s.prompt_ids) + len(s.response_ids) <= 256
        for a, b in spans:
            assert (s.prompt_ids + s.response_ids[:a], s.response_ids[a:b], s.response_log_probs[a:b]) in calls
        assert [k for k, v in enumerate(mask) if v] == [k for a, b in spans for k in range(a, b)]
        ref = hf_token_log_probs(model, s.prompt_ids, s.response_ids, temperature=0.8)
        on = torch.tensor(mask, dtype=torch.bool)
        torch.testing.assert_close(torch.tensor(s.response_log_probs)[on], ref[on], atol=1e-4, rtol=0)
    assert sum(len(s.extra["model_spans"]) >= 3 for s in samples) >= 2


@pytest.mark.slow
@pytest.mark.sglang
def test_update_weights_from_tensor_matches_hf_with_new_weights(engine, tiny_model):
    """Flattened-bucket payloads (shared-memory handles, bytes through Ray) in one bucket and in many."""
    path, _, prompts = tiny_model
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=10)
    before = [s.response_ids for s in engine.generate(prompts, cfg)]
    new = perturbed_state(path)
    v0 = engine.info()[0]["weight_version"]
    t0 = time.time()
    push_weights(engine, sorted(new.items()))
    print(f"\n[rollout] update_weights_from_tensor (full model, one bucket): {time.time() - t0:.2f} s")
    assert engine.info()[0]["weight_version"] == v0 + 1
    after = engine.generate(prompts, cfg)
    model = hf_model(path, new)
    for s, p in zip(after, prompts):
        assert s.response_ids == hf_greedy(model, p, 10, stop_token_ids_for(path)), "engine output != HF with the pushed weights"
        torch.testing.assert_close(torch.tensor(s.response_log_probs), hf_token_log_probs(model, p, s.response_ids),
                                   atol=1e-4, rtol=0)
        assert s.weight_version == v0 + 1
    assert [s.response_ids for s in after] != before
    # the loader fused q/k/v: SGLang's qkv_proj == cat(q, k, v) of what we sent
    ref = torch.cat([new[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv"])
    torch.testing.assert_close(weight(engine, "model.layers.0.self_attn.qkv_proj.weight"), ref)
    # back to the checkpoint in many small buckets
    orig = load_state(path)
    assert push_weights(engine, sorted(orig.items()), bucket_bytes=20000) > 3
    assert [s.response_ids for s in engine.generate(prompts, cfg)] == before


@pytest.mark.slow
@pytest.mark.sglang
def test_validation_rejects_bad_updates_and_engine_survives(engine, tiny_model):
    _, _, prompts = tiny_model
    from rlhf.rollout.sglang_engine import EngineCallError

    with pytest.raises(EngineCallError, match="between begin_weight_update"):
        engine.wait(engine.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[64]], "g"))
    with pytest.raises(TypeError, match="torch.Tensor"):  # tensors never cross Ray on the weight path
        engine.update_weights_from_tensor([[torch.zeros(2)]])
    engine.begin_weight_update()
    with pytest.raises(EngineCallError, match="wrong shapes.*q_proj"):
        engine.wait(engine.update_weights_from_distributed(["model.layers.0.self_attn.q_proj.weight"], ["float32"],
                                                           [[64, 10]], "g"))
    with pytest.raises(EngineCallError, match="payloads for tp_size=1"):
        engine.wait(engine.update_weights_from_tensor([[b"a", b"b"]]))
    engine.end_weight_update()
    assert engine.restarts == [0]
    assert len(engine.generate(prompts[:1], SamplingConfig(temperature=0.0, max_new_tokens=2))) == 1


@pytest.mark.slow
@pytest.mark.sglang
def test_update_weights_from_distributed_gloo_broadcast(engine, tiny_model):
    """The trainer (this process, rank 0) broadcasts one flat bucket over gloo while the engine receives."""
    import torch.distributed as dist
    from sglang.srt.utils.common import init_custom_process_group

    from rlhf.weight_bridge.bucketing import BufferPool, TensorMeta, fill_buckets, plan_buckets

    path, _, prompts = tiny_model
    port = free_port()
    pending = engine.init_weights_update_group("127.0.0.1", port, world_size=2, group_name="rollout_sync",
                                               backend="gloo", rank_offsets=[1])
    pg = init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=0,
                                   group_name="rollout_sync")
    engine.wait(pending)
    new = perturbed_state(path, seed=2)
    named = sorted(new.items())
    [plan] = plan_buckets([TensorMeta(n, tuple(t.shape), t.dtype) for n, t in named], 1 << 30)
    [(_, _, buf)] = list(fill_buckets(iter(named), [plan], BufferPool(plan.nbytes)))
    engine.begin_weight_update()
    pending = engine.update_weights_from_distributed(plan.names, ["float32"] * len(named),
                                                     [list(m.shape) for m in plan.metas], "rollout_sync",
                                                     flush_cache=True)
    dist.broadcast(buf, src=0, group=pg)
    engine.wait(pending)
    engine.end_weight_update()
    model = hf_model(path, new)
    out = engine.generate(prompts, SamplingConfig(temperature=0.0, max_new_tokens=8))
    for s, p in zip(out, prompts):
        assert s.response_ids == hf_greedy(model, p, 8, stop_token_ids_for(path))
    engine.destroy_weights_update_group("rollout_sync")
    dist.destroy_process_group(pg)
    engine.update_weights_from_disk(path)  # back to the checkpoint for later tests
    out = engine.generate(prompts[:1], SamplingConfig(temperature=0.0, max_new_tokens=8))
    assert out[0].response_ids == hf_greedy(hf_model(path), prompts[0], 8, stop_token_ids_for(path))


@pytest.mark.slow
@pytest.mark.sglang
def test_release_and_resume_memory_keep_weights(engine, tiny_model):
    """The colocated lifecycle runs on CPU too: release -> resume weights -> push -> resume KV -> generate.
    Resuming what was never released is never sent to SGLang (its scheduler would fail).  On the module's engine
    (colocated), with the checkpoint's weights pushed first (earlier tests pushed others)."""
    path, _, prompts = tiny_model
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=8)
    state = sorted(load_state(path).items())
    push_weights(engine, state)
    restarts = list(engine.restarts)
    before = [s.response_ids for s in engine.generate(prompts, cfg)]
    engine.resume_memory_occupation()  # nothing released: a no-op, the engine lives on
    engine.release_memory_occupation()
    assert engine.released_tags == ["kv_cache", "weights"]
    with pytest.raises(RuntimeError, match="resume_memory_occupation"):
        engine.generate(prompts, cfg)
    engine.resume_memory_occupation(["weights"])
    push_weights(engine, state)
    engine.resume_memory_occupation(["kv_cache"])
    assert engine.released_tags == [] and engine.restarts == restarts
    assert [s.response_ids for s in engine.generate(prompts, cfg)] == before
    # the engine actor itself refuses a resume of what it holds, and lives on (SGLang's scheduler died on it,
    # the manager replaced the engine and the call reported success)
    import ray

    from rlhf.rollout.sglang_engine import EngineCallError

    with pytest.raises(EngineCallError, match="has not released \\['weights'\\]"):
        ray.get(engine.actors[0].resume_memory_occupation.remote(["weights"]))
    assert engine.restarts == restarts
    assert [s.response_ids for s in engine.generate(prompts, cfg)] == before


@pytest.mark.slow
@pytest.mark.sglang
def test_wrong_shape_update_sent_directly_is_contained(engine, tiny_model):
    """SGLang kills its whole process tree on a wrong-shape load: the engine's actor dies with its schedulers,
    this process lives, and the manager replaces the engine."""
    import psutil

    from rlhf.weight_bridge.bucketing import BufferPool, TensorMeta, fill_buckets, plan_buckets
    from rlhf.weight_bridge.from_tensor import prepare_sharing, serialize_bucket

    path, _, prompts = tiny_model
    push_weights(engine, sorted(load_state(path).items()))  # the trainer has synced at least once
    [pid] = engine.engine_pids()
    children = [c.pid for c in psutil.Process(pid).children(recursive=True)]
    prepare_sharing(torch.device("cpu"))
    bad = [("model.layers.0.self_attn.q_proj.weight", torch.zeros(64, 10))]
    [plan] = plan_buckets([TensorMeta(n, tuple(t.shape), t.dtype) for n, t in bad], 1 << 20)
    [(_, _, buf)] = list(fill_buckets(iter(bad), [plan], BufferPool(plan.nbytes, shared=True)))
    engine.begin_weight_update()
    engine.wait(engine.update_weights_from_tensor([serialize_bucket(buf, plan, 1)]))  # the actor dies: replaced
    assert engine.restarts == [1]
    deadline = time.time() + 60
    while any(psutil.pid_exists(p) for p in [pid] + children) and time.time() < deadline:
        time.sleep(1)
    assert not any(psutil.pid_exists(p) for p in [pid] + children), "engine processes survived their actor"
    # weights were pushed before: the new engine is stale and generates nothing until it has them again
    assert engine.stale_engines() == [0]
    with pytest.raises(StaleEnginesError):
        engine.generate(prompts[:1], SamplingConfig(temperature=0.0, max_new_tokens=8))
    push_weights(engine, sorted(load_state(path).items()))
    assert engine.stale_engines() == []
    out = engine.generate(prompts[:1], SamplingConfig(temperature=0.0, max_new_tokens=8))
    assert out[0].response_ids == hf_greedy(hf_model(path), prompts[0], 8, stop_token_ids_for(path))
