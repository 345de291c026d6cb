"""scripts/convert_checkpoint.py: HF -> megatron (TP2, 2 processes) -> HF is bitwise exact.

The two round trips (dense TP2, MoE EP2 -> TP2) run side by side (``round_trips``, started on first use): each is two
converter processes in turn, mostly interpreter start and imports."""
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file

from tests.support.tiny_models import make_tiny_hf_model
from tests.support.tiny_tokenizer import make_tiny_tokenizer

from tests.support.paths import ROOT
SCRIPT = os.path.join(ROOT, "scripts", "convert_checkpoint.py")


def _run(cmd, env):
    return subprocess.run([sys.executable, SCRIPT, *cmd], env=env, capture_output=True, text=True, timeout=900)


def _round_trip(hf, root, there, back):
    """HF dir `hf` -> megatron (`there` options) -> HF (`back` options); returns the last converter's result (the first
    one's if it failed)."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    for cmd in (["hf-to-mcore", "--hf-path", hf, "--out", str(root / "mcore"), *there],
                ["mcore-to-hf", "--mcore-path", str(root / "mcore"), "--out", str(root / "hf2"), *back]):
        proc = _run(cmd, env)
        if proc.returncode != 0:
            break
    return proc


@pytest.fixture(scope="module")
def round_trips(request, tmp_path_factory):
    """{"dense": (hf dir, out root, future of the last converter's result), "moe": ...}: both round trips in two
    threads; one whose test this session did not collect does not start."""
    from tests.support.model_families import make_family_model

    collected = {item.name for item in request.session.items if getattr(item, "module", None) is not None
                 and item.module.__name__ == __name__}
    pool, out = ThreadPoolExecutor(2), {}
    if "test_convert_round_trip_cli" in collected:
        root = tmp_path_factory.mktemp("dense")
        hf = make_tiny_hf_model(str(root / "hf"), "qwen2_tied", vocab_size=400, tokenizer=make_tiny_tokenizer())
        out["dense"] = (hf, root, pool.submit(_round_trip, hf, root, ["--tp", "2", "--pp", "1"], []))
    if "test_convert_moe_round_trip_with_expert_parallelism" in collected:
        root = tmp_path_factory.mktemp("moe")
        hf = make_family_model(str(root / "hf"), "qwen3_moe", num_layers=2)
        out["moe"] = (hf, root, pool.submit(_round_trip, hf, root, ["--ep", "2"], ["--tp", "2"]))
    yield out
    pool.shutdown()


@pytest.mark.slow
@pytest.mark.dist
def test_convert_round_trip_cli(round_trips):
    hf, tmp_path, future = round_trips["dense"]
    proc = future.result()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    a = load_file(os.path.join(hf, "model.safetensors"))
    b = load_file(str(tmp_path / "hf2" / "model.safetensors"))
    assert set(a) == set(b) and "lm_head.weight" not in b
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert (tmp_path / "hf2" / "tokenizer.json").exists()
    assert not (tmp_path / "mcore.tmp").exists()


@pytest.mark.slow
@pytest.mark.dist
def test_convert_moe_round_trip_with_expert_parallelism(round_trips):
    """Qwen3-MoE: HF -> megatron at EP2 -> HF at TP2 (experts resharded over EP then TP) is bitwise."""
    hf, tmp_path, future = round_trips["moe"]
    proc = future.result()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    a = load_file(os.path.join(hf, "model.safetensors"))
    b = load_file(str(tmp_path / "hf2" / "model.safetensors"))
    assert set(a) == set(b) and "model.layers.1.mlp.experts.7.down_proj.weight" in b
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_convert_refuses_unsupported_model_before_any_work(tmp_path):
    """Exit code 2 with the supported list, from config.json alone (no weights in the directory)."""
    from transformers import GPT2Config

    GPT2Config(architectures=["GPT2LMHeadModel"]).save_pretrained(str(tmp_path / "gpt2"))
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = _run(["hf-to-mcore", "--hf-path", str(tmp_path / "gpt2"), "--out", str(tmp_path / "m")], env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "GPT2LMHeadModel" in proc.stderr and "Qwen3MoeForCausalLM" in proc.stderr
    proc = _run(["hf-to-mcore", "--hf-path", str(tmp_path / "gpt2"), "--out", str(tmp_path / "m"), "--ep", "3"], env)
    assert proc.returncode == 2
