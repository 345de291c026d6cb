"""Initial weights from a megatron dist checkpoint at ``--cfg``: verl's ``<role>.megatron.use_dist_checkpointing`` /
``dist_checkpointing_path`` map to ``actor.*`` / ``critic.*`` (the reference's must equal the actor's), and the
checkpoint is checked from its metadata (parallel.init_checkpoint) before anything is built: it exists, it is a
megatron-core dist checkpoint with model tensors, and their names / shapes are those of config.json.  The
checkpoints here are written by tests/support/mcore_checkpoints.py with hand-written megatron shapes; the
converter's real checkpoints are checked in tests/e2e/test_init_checkpoint_dist.py."""
from __future__ import annotations

import json

import pytest

from rlhf.config import ConfigValidationError, compose_config
from tests.support.mcore_checkpoints import llama_shapes, write_dcp
from tests.support.verl_examples import problems, run_cfg

A, R, C = "actor_rollout_ref.actor.megatron", "actor_rollout_ref.ref.megatron", "critic.megatron"
#: the model of config.json below: Llama, 2 layers, hidden 64, 4 heads / 2 KV heads, ffn 128, vocab 300 (-> 384
#: rows at TP1 x 128)
SIZES = dict(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128)


@pytest.fixture
def model(tmp_path):
    from transformers import LlamaConfig

    path = tmp_path / "llama"
    LlamaConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, max_position_embeddings=256, tie_word_embeddings=False,
                architectures=["LlamaForCausalLM"]).save_pretrained(str(path))
    return str(path)


def _cfg(model, ckpt, *extra):
    return run_cfg(["recipe=quickstart", f"model.path={model}", "actor.use_dist_checkpointing=true",
                    f"actor.dist_checkpointing_path={ckpt}", *extra])


def test_verl_keys_set_the_roles_initial_weights():
    c = compose_config([f"{A}.use_dist_checkpointing=True", f"{A}.dist_checkpointing_path=/ckpt/a",
                        f"{R}.use_dist_checkpointing=True", f"{R}.dist_checkpointing_path=/ckpt/a",
                        f"{C}.use_dist_checkpointing=True", f"{C}.dist_checkpointing_path=/ckpt/c",
                        f"{A}.dist_checkpointing_prefix=''"])
    assert (c.actor.use_dist_checkpointing, c.actor.dist_checkpointing_path) == (True, "/ckpt/a")
    assert (c.critic.use_dist_checkpointing, c.critic.dist_checkpointing_path) == (True, "/ckpt/c")
    assert not compose_config([]).actor.use_dist_checkpointing  # default: the HF safetensors of model.path


def test_reference_from_other_weights_a_key_prefix_and_a_missing_path_are_refused():
    with pytest.raises(ConfigValidationError) as e:
        compose_config([f"{A}.use_dist_checkpointing=True", f"{A}.dist_checkpointing_path=/ckpt/a",
                        f"{R}.use_dist_checkpointing=True", f"{R}.dist_checkpointing_path=/ckpt/b",
                        f"{A}.dist_checkpointing_prefix=module.", f"{C}.use_dist_checkpointing=True"])
    msg = str(e.value)
    assert f"{R}.dist_checkpointing_path='/ckpt/b' is not supported" in msg
    assert f"set {A}.dist_checkpointing_path='/ckpt/b'" in msg  # verl's key, as typed
    assert f"{A}.dist_checkpointing_prefix='module.' is not supported" in msg and "prefix" in msg
    assert f"{C}.use_dist_checkpointing=true needs {C}.dist_checkpointing_path" in msg


def test_cfg_accepts_a_checkpoint_of_the_model(model, tmp_path):
    ckpt = write_dcp(tmp_path / "mcore", llama_shapes(384, **SIZES))
    code, out, err = _cfg(model, ckpt)
    assert code == 0, err
    assert f"dist_checkpointing_path: {ckpt}" in out


@pytest.mark.parametrize("case, expected", [
    ("missing", "does not exist"),
    ("empty", "is not a megatron-core dist checkpoint (no metadata.json); write one with "
              "scripts/convert_checkpoint.py hf-to-mcore"),
    ("trainer", "is a trainer checkpoint; give its actor directory"),
    ("ffn", "tensor decoder.layers.0.mlp.linear_fc1.weight has shape [192, 64]; config.json gives [256, 64]"),
    ("layers", "it holds layers 0..0; config.json gives num_hidden_layers=2"),
    ("vocab", "embedding.word_embeddings.weight has shape [256, 64]; config.json gives [>= 300, 64]"),
    ("tied", "it lacks output_layer.weight (config.json: tie_word_embeddings=false)"),
    ("no_model", "holds no model tensors"),
])
def test_cfg_names_what_is_wrong_with_the_checkpoint(model, tmp_path, case, expected):
    ckpt = tmp_path / "mcore"
    if case == "empty":
        ckpt.mkdir()
    elif case == "trainer":
        write_dcp(ckpt / "actor", llama_shapes(384, **SIZES))
    elif case in ("ffn", "layers", "vocab"):
        sizes = {**SIZES, **{"ffn": dict(ffn=96), "layers": dict(layers=1), "vocab": {}}[case]}
        write_dcp(ckpt, llama_shapes(256 if case == "vocab" else 384, **sizes))
    elif case == "tied":
        write_dcp(ckpt, {k: v for k, v in llama_shapes(384, **SIZES).items() if not k.startswith("output_layer")})
    elif case == "no_model":
        write_dcp(ckpt, {"optimizer.step": (1,)})
    code, _, err = _cfg(model, ckpt)
    assert code == 2
    lines = [p for p in problems(err) if p.startswith("actor.dist_checkpointing_path=")]
    assert any(expected in p for p in lines), err


def test_cfg_checks_the_critics_checkpoint_without_its_lm_head(model, tmp_path):
    """The critic's checkpoint needs no LM head (its value head is new); the actor's does."""
    ckpt = write_dcp(tmp_path / "mcore", {k: v for k, v in llama_shapes(384, **SIZES).items()
                                          if not k.startswith("output_layer")})
    code, _, err = run_cfg(["recipe=quickstart", f"model.path={model}", "algorithm.adv_estimator=gae",
                            "critic.use_dist_checkpointing=true", f"critic.dist_checkpointing_path={ckpt}"])
    assert code == 0, err
    code, _, err = run_cfg(["recipe=quickstart", f"model.path={model}", "algorithm.adv_estimator=gae",
                            "critic.use_dist_checkpointing=true", f"critic.dist_checkpointing_path={tmp_path}"])
    assert code == 2 and any(p.startswith("critic.dist_checkpointing_path=") for p in problems(err)), err


def test_vocab_multiple_rebuilds_the_checkpoints_padded_vocabulary(tmp_path):
    """A checkpoint padded to 1000 rows at TP2 (divisible_by 100) rebuilds with 1000 rows at TP1 and TP4 (megatron
    pads to a multiple of divisible_by * tp); rows that do not split over tp are refused."""
    from parallel.init_checkpoint import vocab_multiple
    from parallel.model_config import padded_vocab_size

    ckpt = write_dcp(tmp_path / "mcore", {"embedding.word_embeddings.weight": (1000, 8)})
    for tp in (1, 2, 4):
        assert padded_vocab_size(998, vocab_multiple(ckpt, tp), tp) == 1000
    with pytest.raises(ValueError, match="do not split over tensor parallel size 3"):
        vocab_multiple(ckpt, 3)
    assert json.loads((tmp_path / "mcore" / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
