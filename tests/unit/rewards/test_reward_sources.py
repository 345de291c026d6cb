"""Reward models and weighted reward sources (rlhf/rewards/reward_model.py, manager.py): a tiny random
LlamaForSequenceClassification built here scores the last token (padding-invariant), in process and
in its own Ray worker; several sources combine with weights; a source that raises or times out
falls back per sample and is counted."""
from __future__ import annotations

import time

import pytest
import torch
from omegaconf import OmegaConf

from rlhf.config.schema import RewardConfig, RewardSourceConfig
from rlhf.rewards.reward_model import HFRewardModelScorer, RayRewardModelScorer, RewardModelScorer
from rlhf.rewards.manager import RewardManager, RewardSource, build_reward_manager

PROMPTS = [[{"role": "user", "content": "What is 2+3?"}], "Tom has 1 apple.", [{"role": "user", "content": "Hi"}]]
RESPONSES = ["2+3=5\n#### 5", "So he has one apple, which is a rather long answer to pad the others", "#### 7"]


def make_tiny_rm(path, seed=0):
    """A random LlamaForSequenceClassification (1 label) with the tiny chat tokenizer."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from rlhf.quickstart.tiny import make_tiny_tokenizer

    tok = make_tiny_tokenizer()
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, num_labels=1,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    model = LlamaForSequenceClassification(cfg)
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)  # clearly non-zero scores
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def tiny_rm(tmp_path_factory):
    return make_tiny_rm(tmp_path_factory.mktemp("rm") / "tiny_rm")


def reference_scores(path, prompts, responses):
    """Each pair alone (no padding) through the HF model's own last-token pooling."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    out = []
    for p, r in zip(prompts, responses):
        msgs = ([{"role": "user", "content": p}] if isinstance(p, str) else p) + [{"role": "assistant", "content": r}]
        ids = tok(tok.apply_chat_template(msgs, tokenize=False), add_special_tokens=False,
                  return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out.append(model(input_ids=ids).logits[0, 0].item())
    return out


def test_hf_scorer_last_token_logit_padding_invariant(tiny_rm):
    ref = reference_scores(tiny_rm, PROMPTS, RESPONSES)
    batched = HFRewardModelScorer(tiny_rm, micro_batch_size=3)
    single = HFRewardModelScorer(tiny_rm, micro_batch_size=1)
    assert isinstance(batched, RewardModelScorer)
    got = batched(PROMPTS, RESPONSES)
    assert got == pytest.approx(ref, abs=1e-5) and single(PROMPTS, RESPONSES) == pytest.approx(ref, abs=1e-5)
    assert len(set(round(x, 4) for x in got)) == 3
    text = batched.render(PROMPTS[0], RESPONSES[0])
    assert text.startswith("<|im_start|>user\nWhat is 2+3?") and "<|im_start|>assistant\n2+3=5" in text
    # left truncation keeps the response end
    short = HFRewardModelScorer(tiny_rm, max_length=8)
    assert short.score(PROMPTS[:1], RESPONSES[:1])[0] == pytest.approx(
        short.score(["a much longer prompt " * 5], RESPONSES[:1])[0], abs=1e-5)


@pytest.mark.slow
def test_ray_worker_scores_like_in_process(tiny_rm, ray_local):  # ray_local: the session's Ray (tests/conftest.py)
    remote = RayRewardModelScorer(tiny_rm, micro_batch_size=2)
    # the worker loads in the background: a start limit it cannot meet stops the run naming the key
    key = r"reward.sources\[0\].start_timeout_s"
    with pytest.raises(TimeoutError, match=key + r"=0.01\); raise " + key):
        remote.wait_ready(0.01, "reward.sources[0].start_timeout_s")
    assert remote.wait_ready(120) < 120
    remote.timeout_s = 5.0  # loaded: the first call answers within a scoring timeout
    assert remote(PROMPTS, RESPONSES) == pytest.approx(HFRewardModelScorer(tiny_rm).score(PROMPTS, RESPONSES),
                                                       abs=1e-5)
    remote.close()


def _reward_cfg(sources, timeout_s=None, fallback=-1.0, custom_path=None, fallback_type="constant"):
    cfg = OmegaConf.structured(RewardConfig)
    cfg.timeout_s, cfg.fallback_score, cfg.fallback.type = timeout_s, fallback, fallback_type
    cfg.custom_reward_function.path = custom_path
    cfg.sources = [OmegaConf.merge(OmegaConf.structured(RewardSourceConfig), s) for s in sources]
    return cfg


FLAKY = """
import time
def compute_score(solution_str, ground_truth):
    if "boom" in solution_str:
        raise RuntimeError("reward server down")
    if "slow" in solution_str:
        time.sleep(3)
    return 0.5
"""


def test_weighted_sources_with_failures(tiny_rm, tmp_path):
    flaky = tmp_path / "flaky.py"
    flaky.write_text(FLAKY)
    rs = build_reward_manager(_reward_cfg([
        {"type": "rule", "weight": 1.0},
        {"type": "custom", "path": str(flaky), "weight": 2.0},
        {"type": "model", "path": tiny_rm, "weight": 0.5, "placement": "local"},
    ], timeout_s=0.5, fallback=-1.0))
    responses = ["#### 5", "boom #### 3", "slow #### 7", "#### 4"]
    prompts = ["1+4=", "1+2=", "3+4=", "x"]
    rm = HFRewardModelScorer(tiny_rm).score(prompts, responses)
    t0 = time.monotonic()
    scores, m = rs.score(responses, ["gsm8k"] * 4, ["5", "3", "7", "9"], prompts=prompts)
    assert time.monotonic() - t0 < 2.5  # the 3 s sleeper is abandoned at 0.5 s
    rule = [1.0, 1.0, 1.0, 0.0]
    custom = [0.5, -1.0, -1.0, 0.5]  # raised / timed out -> fallback_score
    assert scores == pytest.approx([r + 2 * c + 0.5 * x for r, c, x in zip(rule, custom, rm)], abs=1e-5)
    assert m["reward/num_fallbacks"] == 2 and m["reward/custom/num_fallbacks"] == 2
    assert m["reward/rule/num_fallbacks"] == 0 and m["reward/model/num_fallbacks"] == 0
    assert m["reward/rule/mean"] == 0.75 and m["reward/custom/mean"] == pytest.approx(-0.25)


class _Stub:
    def __init__(self, delay=0.0, error=None):
        self.delay, self.error, self.closed = delay, error, False

    def score(self, prompts, responses):
        time.sleep(self.delay)
        if self.error:
            raise self.error
        return [1.0] * len(responses)

    def close(self):
        self.closed = True


@pytest.mark.parametrize("stub,expect_fallback", [
    (_Stub(), False), (_Stub(delay=2.0), True), (_Stub(error=RuntimeError("CUDA OOM")), True)])
def test_model_source_timeout_and_exception_fall_back_per_sample(stub, expect_fallback):
    rs = RewardManager([RewardSource("model", 1.0, scorer=stub), RewardSource("rule", 1.0)], timeout_s=0.3,
                       fallback_score=0.25)
    t0 = time.monotonic()
    scores, m = rs.score(["#### 1", "#### 2", "x"], ["gsm8k"] * 3, ["1", "1", "1"], prompts=["p"] * 3)
    assert time.monotonic() - t0 < 1.5
    model = [0.25] * 3 if expect_fallback else [1.0] * 3
    assert scores == [x + r for x, r in zip(model, [1.0, 0.0, 0.0])]
    assert m["reward/num_fallbacks"] == (3 if expect_fallback else 0)
    rs.close()
    assert stub.closed


def test_default_source_is_rule_or_custom(tmp_path):
    rs = build_reward_manager(_reward_cfg([]))
    assert [s.name for s in rs.sources] == ["rule"]
    scores, m = rs.score(["#### 3", "#### 4"], ["gsm8k", "openai/gsm8k"], ["3", "3"])
    assert scores == [1.0, 0.0]
    assert m == {"reward/num_fallbacks": 0, "reward/rule/num_fallbacks": 0, "reward/num_unscorable": 0}
    f = tmp_path / "r.py"
    f.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 2.0\n")
    rs = build_reward_manager(_reward_cfg([], custom_path=str(f)))
    assert [s.name for s in rs.sources] == ["custom"] and rs.score(["a"], ["any"], [None])[0] == [2.0]


def test_build_errors(tmp_path):
    with pytest.raises(ValueError, match="type='judge'"):
        build_reward_manager(_reward_cfg([{"type": "judge"}]))
    with pytest.raises(ValueError, match="needs a path"):
        build_reward_manager(_reward_cfg([{"type": "model"}]))
    with pytest.raises(ValueError, match="placement"):
        build_reward_manager(_reward_cfg([{"type": "model", "path": "x", "placement": "gpu0"}]))
    with pytest.raises(FileNotFoundError):
        build_reward_manager(_reward_cfg([{"type": "custom", "path": str(tmp_path / "missing.py")}]))
    # two sources of one type get distinct names
    rs = build_reward_manager(_reward_cfg([{"type": "rule", "weight": 1.0}, {"type": "rule", "weight": 0.5}]))
    assert [s.name for s in rs.sources] == ["rule0", "rule1"]


def test_fallbacks_are_one_warning_per_batch(caplog):
    """6 samples, a model source whose 3 micro batches (2 pairs each) all time out, and a rule source that raises
    on 2 samples: one summary warning for the batch (counts and reasons), no line per sample or micro batch."""
    def flaky_rule(data_source, solution_str, ground_truth, extra_info=None):
        if "boom" in solution_str:
            raise RuntimeError("rule server down")
        return 1.0

    rs = RewardManager([RewardSource("model", 1.0, scorer=_Stub(delay=1.0), chunk_size=2),
                        RewardSource("custom", 1.0, fn=flaky_rule)], timeout_s=0.2, fallback_score=0.0)
    responses = ["#### 1", "boom", "#### 2", "boom", "x", "y"]
    with caplog.at_level("WARNING", logger="rlhf.rewards"):
        _, m = rs.score(responses, ["gsm8k"] * 6, ["1"] * 6, prompts=["p"] * 6)
    assert m["reward/model/num_fallbacks"] == 6 and m["reward/custom/num_fallbacks"] == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings
    assert "model: 6/6 samples fell back (6 x model timed out (0.2s, reward.timeout_s))" in warnings[0]
    assert "custom: 2/6 samples fell back (2 x " in warnings[0] and "flaky_rule: RuntimeError: rule server down); constant fallback" in warnings[0]
    assert "reward/num_fallbacks=8" in warnings[0]


class _SlowStart(_Stub):
    """A model scorer whose worker is still loading: wait_ready raises as RayRewardModelScorer's does."""
    waited: list = []

    def __init__(self, path, num_gpus=0.0, **kwargs):
        super().__init__()

    def wait_ready(self, timeout_s, key):
        _SlowStart.waited.append((timeout_s, key))
        raise TimeoutError(f"not loaded after {timeout_s} s ({key}={timeout_s}); raise {key}")


def test_build_waits_for_the_reward_model_with_its_start_timeout(monkeypatch):
    """build_reward_manager waits for each Ray reward model before returning (so the first batch is never
    scored by fallbacks), with reward.sources[i].start_timeout_s; past it the build fails naming the key."""
    from rlhf.rewards import reward_model

    monkeypatch.setattr(reward_model, "RayRewardModelScorer", _SlowStart)
    cfg = _reward_cfg([{"type": "rule"}, {"type": "model", "path": "rm", "start_timeout_s": 42.0}])
    assert OmegaConf.structured(RewardSourceConfig).start_timeout_s == 600.0  # generous default
    with pytest.raises(TimeoutError, match=r"reward.sources\[1\].start_timeout_s=42.0"):
        build_reward_manager(cfg)
    assert _SlowStart.waited == [(42.0, "reward.sources[1].start_timeout_s")]


def test_reward_models_on_gpus_are_refused_and_config_models_run_on_the_cpu(monkeypatch):
    """A reward model on GPUs is neither placed nor in the memory plan: ``num_gpus > 0`` is refused at ``--cfg``
    (validate_config) naming the fix.  Built from the config, both placements load the model on the CPU, also in a
    Ray worker without Ray GPUs, which would otherwise see every GPU of its node (Ray leaves CUDA_VISIBLE_DEVICES
    alone then) and take cuda:0, a trainer rank's GPU; a worker Ray gave GPUs uses them ("cuda")."""
    import types

    import ray

    from rlhf.config import ConfigError, compose_config, validate_config
    from rlhf.rewards import reward_model

    cfg = compose_config(["reward.sources=[{type:model,path:/models/rm,num_gpus:1}]"])
    with pytest.raises(ConfigError, match=r"reward.sources\[0\].num_gpus=1.0: a reward model on GPUs is neither "
                                          r"placed nor in the memory plan.*set num_gpus=0"):
        validate_config(cfg)
    built = []

    class Rec(_Stub):
        def __init__(self, path, **kwargs):
            built.append((type(self).__name__, kwargs.get("num_gpus"), kwargs.get("device")))
            super().__init__()

        def wait_ready(self, timeout_s, key):
            return 0.0

    monkeypatch.setattr(reward_model, "RayRewardModelScorer", type("Ray", (Rec,), {}))
    monkeypatch.setattr(reward_model, "HFRewardModelScorer", type("Local", (Rec,), {}))
    build_reward_manager(_reward_cfg([{"type": "model", "path": "rm"},
                                      {"type": "model", "path": "rm", "placement": "local"}]))
    assert built == [("Ray", 0.0, "cpu"), ("Local", None, "cpu")]
    started = []

    class Remote:  # ray.remote(cls).options(...).remote(path, **kwargs), recorded
        def __init__(self, cls):
            self.options = lambda **o: types.SimpleNamespace(remote=lambda path, **kw: started.append((o, kw)))

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "remote", Remote)
    RayRewardModelScorer("rm", micro_batch_size=2)
    RayRewardModelScorer("rm", num_gpus=1)
    assert [(o["num_gpus"], kw["device"]) for o, kw in started] == [(0.0, "cpu"), (1, "cuda")]
