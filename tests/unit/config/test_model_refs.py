"""model.critic_path and reward-model paths take every reference the actor's model.path takes (tiny://quickstart,
hub names, local directories), resolved by the same collective helper; object:// tokenizers and reward callables
reach the tokenizer loader and the reward builder.  One gloo rank, CPU."""
from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from rlhf.config import compose_config
from rlhf.config.objects import register_object


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    if dist.is_initialized():
        yield
        return
    store = tmp_path_factory.mktemp("store") / "f"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_critic_and_reward_model_paths_resolve_like_the_actors(tmp_path, one_rank):
    from rlhf.workers.build import resolve_model_path, resolve_reward_paths

    local = tmp_path / "rm"
    local.mkdir()
    cfg = compose_config([f"trainer.default_local_dir={tmp_path / 'run'}", "model.warmup_steps=1",
                          "model.critic_path=tiny://quickstart",
                          f"reward.sources=[{{type: model, path: 'tiny://quickstart'}}, {{type: model, path: '{local}'}}, "
                          f"{{type: rule}}]"])
    actor = resolve_model_path(cfg)  # model.path defaults to tiny://quickstart
    assert actor == str(tmp_path / "run" / "tiny_model" / "tiny_quickstart_model") and os.path.isfile(
        os.path.join(actor, "config.json"))
    assert resolve_model_path(cfg, cfg.model.critic_path) == actor  # the critic's reference, the same resolver
    reward = resolve_reward_paths(cfg)
    assert [s.path for s in reward.sources] == [actor, str(local), None]
    assert cfg.reward.sources[0].path == "tiny://quickstart"  # the config itself is left as written


def test_object_tokenizer_and_reward_callable_reach_their_builders(one_rank):
    from rlhf.rewards.manager import build_reward_manager
    from rlhf.rewards.registry import load_custom_reward_fn
    from rlhf.workers.build import load_tokenizer
    from tests.support.tiny_tokenizer import make_tiny_tokenizer

    tok = make_tiny_tokenizer()
    cfg = compose_config([f"model.tokenizer_path={register_object(tok, 'tokenizer')}"])
    assert load_tokenizer(cfg, "/unused") is tok

    def reward(data_source, solution_str, ground_truth, extra_info=None):
        return float(solution_str == ground_truth)

    uri = register_object(reward, "reward")
    assert load_custom_reward_fn(uri) is reward
    manager = build_reward_manager(compose_config([f"reward.sources=[{{type: custom, path: '{uri}'}}]"]).reward)
    scores, metrics = manager.score(["7", "8"], ["any", "any"], ["7", "7"])
    assert scores == [1.0, 0.0] and metrics["reward/num_fallbacks"] == 0.0
