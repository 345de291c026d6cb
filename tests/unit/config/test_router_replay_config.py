"""MoE routing replay's config (verl's ``actor_rollout_ref.actor.router_replay.mode`` and
``actor_rollout_ref.rollout.enable_rollout_routing_replay``): verl's keys map onto ours, verl's R3 example composes
under --cfg on a local HF config shaped like Qwen3-30B-A3B (colocated engines over 6 nodes under EP8), and what R2 / R3 need or
do not combine with is refused at --cfg naming the key and the fix (exit code 2).  verl's R2 example (dynamic
batching, DeepEP) composes.  verl's DeepEP keys (tests/unit/config/test_deepep_config.py)."""
from __future__ import annotations

import contextlib
import io
import json

import pytest

from rlhf.config import ConfigValidationError, compose_config, validate_config
from rlhf.main import main
from tests.support.verl_examples import example_args, problems, run_cfg

R3_EXAMPLE = "router_replay/run_qwen30_a3b_megatron_sglang.sh"

#: Qwen3-30B-A3B's config.json (its published sizes): 48 layers, 128 experts top-8, GQA 32 / 4 heads of 128
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "tie_word_embeddings": False, "router_aux_loss_coef": 0.001, "torch_dtype": "bfloat16",
    "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu", "attention_bias": False,
}


@pytest.fixture
def paths(tmp_path, gsm8k_row_file):
    model = tmp_path / "Qwen3-30B-A3B"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    return {"train": gsm8k_row_file, "test": gsm8k_row_file, "model": str(model), "ckpt": str(tmp_path / "ckpt"),
            "mcore": str(tmp_path / "mcore")}


def test_verl_keys_map_onto_ours():
    cfg = compose_config(["actor_rollout_ref.actor.router_replay.mode=R3",
                          "actor_rollout_ref.rollout.enable_rollout_routing_replay=True"])
    assert cfg.actor.router_replay.mode == "R3" and cfg.rollout.enable_rollout_routing_replay is True
    assert compose_config(["actor_rollout_ref.actor.router_replay.mode=R2"]).actor.router_replay.mode == "R2"
    default = compose_config([])
    assert default.actor.router_replay.mode == "disabled" and default.rollout.enable_rollout_routing_replay is False


def test_verl_reference_router_replay_is_named_as_without_effect(caplog):
    """verl's ``actor_rollout_ref.ref.router_replay.mode``: verl's compute_ref_log_prob sets no RouterReplay action,
    so the reference routes on its own there as here; the key is accepted and the warning says why."""
    with caplog.at_level("WARNING", logger="rlhf.config"):
        cfg = compose_config(["actor_rollout_ref.ref.router_replay.mode=R3"])
    assert cfg.actor.router_replay.mode == "disabled"
    msg = " ".join(r.getMessage() for r in caplog.records)
    assert "actor_rollout_ref.ref.router_replay.mode (the reference routes on its own, as verl's" in msg, msg


def test_verl_r3_example_composes_on_a_qwen3_30b_a3b_config(paths, monkeypatch):
    """verl's R3 example as written, on a config.json of Qwen3-30B-A3B's sizes, composes (exit 0): routing replay R3,
    DeepEP's flex dispatcher (its CUDA / deep_ep check comes at start), PP6 x EP8 on 6 nodes of 8 GPUs with 12
    colocated engines of TP4 (verl's replica count), whose pipeline-stage leaders sit on 6 nodes.  Before: exit 2,
    colocated engines under expert parallelism mapped the stage leaders' buckets (rank 0's node only); now each
    engine rank maps the trainer rank on its own GPU (rlhf/weight_bridge/from_tensor.py).  With its engines in a
    pool of their own (verl's hybrid_engine=False + rollout.nnodes / n_gpus_per_node) it composes too.  Its memory
    plan fits 48 x 80 GiB."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    args = example_args(R3_EXAMPLE, paths)[1:]
    assert any("moe_enable_deepep=True" in a for a in args) and any("dispatcher_type=flex" in a for a in args)
    assert not any("hybrid_engine" in a or "rollout.nnodes" in a for a in args)  # colocated, as verl runs it
    for extra in ([], ["actor_rollout_ref.hybrid_engine=False", "actor_rollout_ref.rollout.nnodes=1",
                       "actor_rollout_ref.rollout.n_gpus_per_node=8"]):
        code, out, err = run_cfg(["--cfg", "job", *args, *extra])
        assert code == 0, err
        assert "router_replay:\n    mode: R3" in out and "enable_rollout_routing_replay: true" in out
        assert "moe_token_dispatcher_type: flex" in out and "moe_enable_deepep: true" in out
        assert "expert_model_parallel_size: 8" in out and "pipeline_model_parallel_size: 6" in out
        assert paths["model"] in out
        if not extra:
            assert "num_engines: 12" in out and "mode: colocated" in out and "nnodes: 6" in out, out
    # its memory plan: a holder on every engine GPU, no engine process's CUDA context on a stage leader's GPU
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main([*args, "--plan-memory=80"]) == 0, err.getvalue()
    table = out.getvalue()
    assert "48 GPUs of 80 GiB" in table and "TP1 PP6 DP8 EP8" in table and table.rstrip().endswith("fits"), table
    assert "weight sync " in table and "contexts on the stage leader" not in table, table


@pytest.mark.parametrize("overrides, expected", [
    (["actor.router_replay.mode=R3"], "actor.router_replay.mode=R3 replays the engines' routing, which they return "
                                      "only with rollout.enable_rollout_routing_replay=true"),
    (["actor.router_replay.mode=R2", "parallel.context_parallel_size=2"],
     "actor.router_replay.mode=R2 with parallel.context_parallel_size=2 is not supported"),
    (["rollout.enable_rollout_routing_replay=true", "rollout.multi_turn.enable=true"],
     "rollout.enable_rollout_routing_replay=true with rollout.multi_turn.enable=true is not supported"),
    (["rollout.enable_rollout_routing_replay=true", "async_training.enable=true", "async_training.partial_rollout=true"],
     "async_training.partial_rollout=true with rollout.enable_rollout_routing_replay=true: a request continued after "
     "a weight sync is prefilled again"),
])
def test_what_replay_needs_is_checked(overrides, expected):
    with pytest.raises(ConfigValidationError) as e:
        validate_config(compose_config(overrides), world_size=1)
    assert expected in str(e.value)


def test_bad_mode_and_verl_spelling_at_cfg(capsys, tmp_path):
    assert main(["--cfg", "job", "actor_rollout_ref.actor.router_replay.mode=R4",
                 f"trainer.default_local_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "R4" in err and "must be disabled, R2 or R3" in err
    code, _, err = run_cfg(["job", "actor_rollout_ref.actor.router_replay.mode=R3",
                            f"trainer.default_local_dir={tmp_path}"])
    assert code == 2 and any("enable_rollout_routing_replay" in p for p in problems(err))
    code, _, err = run_cfg(["job", "actor_rollout_ref.actor.router_replay.mode=R2",
                            "actor_rollout_ref.actor.router_replay.record_file=/tmp/x",
                            f"trainer.default_local_dir={tmp_path}"])
    assert code == 2 and "record_file" in err


def test_verl_r2_example_composes(paths, monkeypatch):
    """verl's R2 example (one node, TP2 x EP8, DeepEP) composes: R2 on, flex."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    code, out, err = run_cfg(["--cfg", "job", *example_args("router_replay/run_qwen30_a3b_megatron_vllm.sh",
                                                              paths)[1:]])
    assert code == 0, err
    assert "router_replay:\n    mode: R2" in out and "moe_token_dispatcher_type: flex" in out


def test_recipe_composes_at_cfg(capsys, tmp_path):
    assert main(["recipe=moe_r3_tiny_cpu", f"trainer.default_local_dir={tmp_path}", "--cfg", "job"]) == 0
    out = capsys.readouterr().out
    assert "path: tiny://quickstart-moe" in out and "router_replay:\n    mode: R3" in out
    cfg = compose_config([f"trainer.default_local_dir={tmp_path}"], recipe="moe_r3_tiny_cpu")
    validate_config(cfg, world_size=1)


#: a dense Qwen3 config.json (Qwen3-30B-A3B's attention, no experts)
QWEN3_DENSE = {k: v for k, v in QWEN3_30B_A3B.items() if k not in (
    "moe_intermediate_size", "num_experts", "num_experts_per_tok", "norm_topk_prob", "decoder_sparse_step",
    "mlp_only_layers", "router_aux_loss_coef")} | {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                                                    "num_hidden_layers": 4}


@pytest.mark.parametrize("verl", [True, False])
def test_replay_on_a_dense_model_is_refused_at_cfg(tmp_path, verl):
    """Routing replay on a model without MoE layers: refused at --cfg from its config.json (exit 2), naming the key
    as typed (verl's where the user wrote verl's) and the fix -- not after the engines launched (workers/build.py)."""
    model = tmp_path / "Qwen3-dense"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3_DENSE))
    pre = "actor_rollout_ref." if verl else ""
    code, _, err = run_cfg(["job", f"{pre}model.path={model}", f"{pre}actor.router_replay.mode=R3",
                            f"{pre}rollout.enable_rollout_routing_replay={'True' if verl else 'true'}",
                            f"trainer.default_local_dir={tmp_path / 'ckpt'}"])
    assert code == 2, err
    lines = [p for p in problems(err) if "MoE" in p]
    assert len(lines) == 1, err
    assert f"{pre}actor.router_replay.mode=R3" in lines[0] and "Qwen3ForCausalLM" in lines[0], lines
    assert f"set {pre}actor.router_replay.mode=disabled" in lines[0], lines
    assert f"{pre}rollout.enable_rollout_routing_replay=false" in lines[0], lines
    code, _, err = run_cfg(["job", f"{pre}model.path={model}", f"{pre}actor.router_replay.mode=disabled",
                            f"trainer.default_local_dir={tmp_path / 'ckpt'}"])
    assert code == 0, err  # replay off: the dense model is fine


@pytest.mark.parametrize("path", ["tiny://quickstart", "tiny://calc"])
def test_replay_on_a_dense_tiny_model_is_refused_at_cfg(tmp_path, path):
    """A tiny model has no config.json before the run builds it: the dense ones are known by name and refused at
    --cfg (exit 2), not after the engines launched; tiny://quickstart-moe passes (test_recipe_composes_at_cfg)."""
    code, _, err = run_cfg(["job", "recipe=quickstart", f"model.path={path}", "actor.router_replay.mode=R2",
                            f"trainer.default_local_dir={tmp_path}"])
    assert code == 2, err
    lines = [p for p in problems(err) if "MoE" in p]
    assert len(lines) == 1 and "actor.router_replay.mode=R2" in lines[0], err
    assert f"model.path='{path}' (LlamaForCausalLM) has no MoE layer" in lines[0], lines


def test_the_build_time_check_is_a_config_error():
    """A caller without check_files (rlhf.workers.build.routing_replay_on): a ConfigError (rlhf.main: exit 2)."""
    from rlhf.config import ConfigError
    from rlhf.workers.build import routing_replay_on
    from transformers import Qwen3Config

    cfg = compose_config(["actor.router_replay.mode=R2"])
    with pytest.raises(ConfigError, match="no MoE layer"):
        routing_replay_on(cfg, Qwen3Config(**{k: v for k, v in QWEN3_DENSE.items() if k != "architectures"},
                                           architectures=["Qwen3ForCausalLM"]))
