"""The engines' dtype, KV-cache size, idle behaviour, token-id mode, CPU threads and start order, from the config
(no engine or model is started)."""
import os

import pytest
import torch

from rlhf.config.compose import compose_config
from rlhf.config.validate import config_problems
from rlhf.rollout.engine_args import (MAX_BATCH_KV_TOKENS, batch_kv_tokens, engine_env, engine_kwargs,
                                      expected_weights_from_checkpoint, resolve_engine_dtype)


def test_auto_dtype_is_the_trainers_dtype_quickstart_fp32():
    cfg = compose_config([], recipe="quickstart")
    assert str(cfg.model.dtype) == "float32" and str(cfg.rollout.dtype) == "auto"
    # SGLang's own "auto" would run this fp32 checkpoint in float16; the engines serve what the actor trains.
    assert resolve_engine_dtype(cfg.rollout.dtype, cfg.model.dtype) == "float32"


def test_auto_dtype_is_the_trainers_dtype_bf16_gpu_recipe():
    cfg = compose_config(["rollout.dtype=auto"], recipe="grpo_qwen2_7b")
    assert str(cfg.model.dtype) == "bfloat16"
    assert resolve_engine_dtype(cfg.rollout.dtype, cfg.model.dtype) == "bfloat16"


def test_explicit_rollout_dtype_wins_and_bad_names_are_refused():
    assert resolve_engine_dtype("float16", "float32") == "float16"
    with pytest.raises(ValueError, match="rollout.dtype"):
        resolve_engine_dtype("fp8", "float32")
    with pytest.raises(ValueError, match="model.dtype"):
        resolve_engine_dtype("auto", "int8")


def test_weight_sync_dtype_follows_the_resolved_engine_dtype(tmp_path):
    # an fp32 checkpoint (as tiny://quickstart is saved): SGLang's "auto" would expect float16 weights
    from rlhf.quickstart.tiny import make_tiny_hf_model

    path = make_tiny_hf_model(str(tmp_path / "m"), num_layers=1, hidden_size=32)
    assert {dt for _, dt in expected_weights_from_checkpoint(path, "auto").values()} == {torch.float16}
    assert {dt for _, dt in expected_weights_from_checkpoint(
        path, resolve_engine_dtype("auto", "float32")).values()} == {torch.float32}


def test_batch_kv_tokens_sizes_the_cache_to_an_engines_share_of_the_batch():
    # grpo_tiny_cpu: 16 prompts x 4 responses x (64 + 16 + 8) tokens on one engine; val 64 x 1 x 88 (equal)
    assert batch_kv_tokens(16, 4, 64, 16, val_prompts=64, val_n=1) == 16 * 4 * 88 == 5632
    # two engines: ceil(15 / 2) = 8 prompts each, n=4 -> 32 sequences of 88
    assert batch_kv_tokens(15, 4, 64, 16, num_engines=2) == 8 * 4 * 88
    # the validation batch is larger: 512 prompts x 1 response
    assert batch_kv_tokens(8, 2, 64, 16, val_prompts=512, val_n=1) == 512 * 88
    # capped; never below one request's context
    assert batch_kv_tokens(1024, 16, 1024, 1024) == MAX_BATCH_KV_TOKENS
    assert batch_kv_tokens(1, 1, 64, 16, cap=10) == 88
    with pytest.raises(ValueError, match="num_engines"):
        batch_kv_tokens(16, 4, 64, 16, num_engines=0)


def test_rollout_max_total_tokens_key_is_checked():
    assert compose_config([], recipe="grpo_tiny_cpu").rollout.max_total_tokens is None
    assert compose_config(["rollout.max_total_tokens=4096"], recipe="grpo_tiny_cpu").rollout.max_total_tokens == 4096
    problems = config_problems(compose_config(["rollout.max_total_tokens=0"], recipe="grpo_tiny_cpu"))
    assert any("rollout.max_total_tokens=0 must be >= 1 (or null)" in p for p in problems), problems


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_engines_sleep_on_idle_and_take_the_kv_size_on_both_devices(tmp_path, device):
    (tmp_path / "config.json").write_text("{}")
    kw = engine_kwargs(str(tmp_path), device=device, max_total_tokens=5632)
    assert kw["sleep_on_idle"] is True and kw["max_total_tokens"] == 5632
    # token ids in, token ids + log-probs out: no tokenizer in the engine, no detokenizer process
    assert kw["skip_tokenizer_init"] is True


@pytest.mark.parametrize("graphs", [{}, {"disable_cuda_graph": True}, {"disable_cuda_graph": False}])
def test_cpu_torch_compile_is_refused_its_frozen_weights_would_ignore_every_sync(tmp_path, graphs):
    """SGLang's CPU engine compiles with inductor freezing whenever enable_torch_compile is set; our CPU defaults
    set disable_cuda_graph=True, which does not stop it, so every CPU form is refused."""
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="enable_torch_compile=True on a CPU engine.*drop enable_torch_compile"):
        engine_kwargs(str(tmp_path), device="cpu", enable_torch_compile=True, **graphs)
    # on GPU CUDA graphs read the parameters' memory in place
    assert engine_kwargs(str(tmp_path), device="cuda", enable_torch_compile=True, **graphs)["enable_torch_compile"]


@pytest.mark.parametrize("placement,tp,want", [("colocated", 2, "false"), ("colocated", 1, None),
                                               ("disaggregated", 2, None)])
def test_colocated_gpu_engines_start_without_sglangs_tp_memory_balance_check(tmp_path, monkeypatch, placement, tp,
                                                                             want):
    """A colocated GPU engine of TP > 1 shares its GPUs with trainer ranks holding different amounts (pipeline
    stages): SGLang's check that every TP rank's free memory is within 0.9 of the least would refuse to start it;
    the actor RolloutManager creates gets the switch off in its environment, which SGLang reads as off.  A TP 1
    engine has nothing to balance; disaggregated engines own their GPUs (the check stays)."""
    import ray

    from rlhf.rollout.engine_args import TP_MEMORY_CHECK_ENV
    from rlhf.rollout.manager import RolloutManager
    from tests.support.tiny_models import make_tiny_hf_model

    make_tiny_hf_model(str(tmp_path), "llama_gqa", vocab_size=64, num_layers=1)
    options = []

    class Remote:
        def options(self, **opts):
            options.append(opts)
            return self

        def remote(self, *args):
            return "actor"

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "remote", lambda cls: Remote())
    m = RolloutManager(1, dict(model_path=str(tmp_path), device="cuda", tp_size=tp), placement=placement, start=False)
    assert m._make_actor(0) == "actor"
    env = options[-1]["runtime_env"]["env_vars"]
    assert env.get(TP_MEMORY_CHECK_ENV) == want and env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] == "1"
    if want is not None:
        from sglang.srt.environ import envs

        monkeypatch.setenv(TP_MEMORY_CHECK_ENV, want)
        assert envs.SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK.get() is False


def test_cpu_engine_of_tp2_runs_without_the_tp_memory_balance_check():
    """A CPU engine's TP ranks measure the same host memory, each at its own moment; another process's memory moving
    by 10 % in between refused a TP2 engine's start ("The memory capacity is unbalanced")."""
    from rlhf.rollout.engine_args import TP_MEMORY_CHECK_ENV, engine_env

    assert engine_env(dict(device="cpu", tp_size=2))[TP_MEMORY_CHECK_ENV] == "false"
    assert TP_MEMORY_CHECK_ENV not in engine_env(dict(device="cpu", tp_size=1))


def test_cpu_engine_threads_split_the_cores_between_the_engine_ranks():
    from rlhf.rollout.sglang_cpu import cpu_engine_env, engine_threads

    assert engine_threads(1, num_cores=2) == 2 and engine_threads(2, num_cores=8) == 4
    assert engine_threads(4, num_cores=2) == 1  # never 0
    with pytest.raises(ValueError, match="tp_size"):
        engine_threads(0)
    cores = len(os.sched_getaffinity(0))
    # Ray gives a zero-CPU actor OMP_NUM_THREADS=1 and the launcher's CPU ranks cores / ranks: the engine's own
    # value replaces both (it computes while the trainer waits for the rollout)
    assert cpu_engine_env(1, base_env={"OMP_NUM_THREADS": "1"})["OMP_NUM_THREADS"] == str(cores)
    assert cpu_engine_env(2, base_env={})["OMP_NUM_THREADS"] == str(max(1, cores // 2))
    # threads that wait at a parallel region's end sleep instead of spinning on a core another thread needs
    assert cpu_engine_env(1, base_env={})["OMP_WAIT_POLICY"] == "PASSIVE"
    # what the engine actor is started with (rlhf.rollout.engine_args.engine_env): CPU engines only
    assert engine_env({"device": "cpu", "tp_size": 1})["OMP_NUM_THREADS"] == str(cores)
    assert "OMP_NUM_THREADS" not in engine_env({"device": "cuda", "tp_size": 1})


@pytest.mark.parametrize("mode,device,early", [("colocated", "cpu", True), ("disaggregated", "cpu", True),
                                               ("disaggregated", "cuda", True), ("colocated", "cuda", False),
                                               ("colocated", "meta", False)])
def test_engines_start_while_the_models_build_unless_they_share_the_trainers_gpus(mode, device, early):
    from rlhf.rollout.placement import engines_start_early

    # colocated GPU engines size their KV cache from the memory the trainer's models leave: they start after them
    assert engines_start_early(mode, device) is early
    with pytest.raises(ValueError, match="rollout.mode"):
        engines_start_early("hybrid", device)


def test_named_engine_dtypes_are_sglangs_without_importing_it(tmp_path):
    import json
    import subprocess
    import sys

    from sglang.srt.configs.model_config import _get_and_verify_dtype

    from rlhf.rollout.engine_args import ENGINE_DTYPES, engine_compute_dtype

    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float32", "model_type": "llama"}))
    for name in ENGINE_DTYPES:
        assert engine_compute_dtype(str(tmp_path), name) == _get_and_verify_dtype({"dtype": "float32"}, name), name
    # the trainer resolves the dtype its engines start with before it launches them: no SGLang import there
    code = (f"import sys; from rlhf.rollout.engine_args import engine_compute_dtype; "
            f"print(engine_compute_dtype({str(tmp_path)!r}, 'float32'), 'sglang' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["torch.float32", "False"]


def test_trainer_and_engines_share_one_nccl_cumem_setting(monkeypatch):
    """SGLang sets NCCL_CUMEM_ENABLE=0 in its processes when unset; the trainer left NCCL's default, so the
    weight-update groups mixed two settings (a known weight-sync hang in peers).  Now the trainer takes SGLang's
    value before any communicator, a user's own value wins, and the engines get the trainer's value."""
    from rlhf.rollout.engine_args import engine_env, share_nccl_env

    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    assert engine_env({"device": "cuda", "tp_size": 1})["NCCL_CUMEM_ENABLE"] == "0"
    share_nccl_env()
    assert os.environ["NCCL_CUMEM_ENABLE"] == "0"
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "1")
    share_nccl_env()
    assert os.environ["NCCL_CUMEM_ENABLE"] == "1"
    assert engine_env({"device": "cuda", "tp_size": 2}, colocated=True)["NCCL_CUMEM_ENABLE"] == "1"
