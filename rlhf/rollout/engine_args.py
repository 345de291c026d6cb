"""What an SGLang engine is started with: validated ``sglang.Engine`` kwargs, its process environment,
and the weights it will accept (from the checkpoint's safetensors headers, read before any engine starts)."""
from __future__ import annotations

import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from rlhf.rollout import sglang_cpu
from rlhf.rollout.engine_loader import LOADER

__all__ = ["engine_kwargs", "server_args_problems", "engine_env", "TP_MEMORY_CHECK_ENV", "NCCL_SHARED_ENV",
           "share_nccl_env", "expected_weights_from_checkpoint", "engine_compute_dtype", "ENGINE_DTYPES",
           "resolve_engine_dtype", "batch_kv_tokens", "rollout_context_length", "MAX_BATCH_KV_TOKENS"]

ENGINE_DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16,
                 "half": torch.float16, "bfloat16": torch.bfloat16}
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def resolve_engine_dtype(rollout_dtype: str, trainer_dtype: str) -> str:
    """The dtype the engines are started in: ``rollout.dtype``, where ``"auto"`` means the trainer's
    ``model.dtype`` -- the engines serve the weights the actor trains, in its precision (an fp32 actor gets
    fp32 engines, a bf16 actor bf16 ones), and the weight sync sends them without a cast.  SGLang's own
    ``"auto"`` would run float32 checkpoints in float16 (slower on CPUs without fp16 matmuls, and a
    different precision from the trainer's on any device).

    Raises:
        ValueError: either value not a known dtype name.
    """
    rollout_dtype, trainer_dtype = str(rollout_dtype), str(trainer_dtype)
    if trainer_dtype not in ENGINE_DTYPES:
        raise ValueError(f"model.dtype must be one of {sorted(ENGINE_DTYPES)}, got {trainer_dtype!r}")
    if rollout_dtype == "auto":
        return trainer_dtype
    if rollout_dtype not in ENGINE_DTYPES:
        raise ValueError(f"rollout.dtype must be 'auto' or one of {sorted(ENGINE_DTYPES)}, got {rollout_dtype!r}")
    return rollout_dtype


#: Upper bound of :func:`batch_kv_tokens` (~57 GB of bf16 KV for a 7B Qwen2 with 4 KV heads).
MAX_BATCH_KV_TOKENS = 1 << 20


def batch_kv_tokens(prompts: int, n: int, max_prompt_length: int, max_response_length: int, num_engines: int = 1,
                    val_prompts: int = 0, val_n: int = 1, cap: int = MAX_BATCH_KV_TOKENS) -> int:
    """KV-cache tokens for one engine to hold its whole share of a rollout batch at once: an engine serves
    ``ceil(prompts / num_engines)`` prompts (a prompt's ``n`` responses stay on one engine) of at most
    ``max_prompt_length + max_response_length + 8`` tokens each (the engines' context length and 8 spare), for the
    training batch and for the validation batch (``val_prompts`` x ``val_n``), whichever is larger.  Clamped
    to ``[context length, cap]``: one request always fits; more than ``cap`` only costs memory (SGLang
    queues what does not fit).  E.g. 16 prompts x 4 x (64 + 16 + 8) on one engine -> 5632.

    Raises:
        ValueError: a count or length < 1 (or ``val_prompts`` < 0).
    """
    for name, v in (("prompts", prompts), ("n", n), ("max_prompt_length", max_prompt_length),
                    ("max_response_length", max_response_length), ("num_engines", num_engines), ("val_n", val_n),
                    ("cap", cap)):
        if int(v) < 1:
            raise ValueError(f"{name} must be >= 1, got {v!r}")
    if int(val_prompts) < 0:
        raise ValueError(f"val_prompts must be >= 0, got {val_prompts!r}")
    per_seq = int(max_prompt_length) + int(max_response_length) + 8
    per_engine = lambda p: -(-int(p) // int(num_engines))  # noqa: E731 (ceil division)
    seqs = max(per_engine(prompts) * int(n), per_engine(val_prompts) * int(val_n))
    return max(per_seq, min(seqs * per_seq, int(cap)))


def rollout_context_length(max_prompt_length: int, max_response_length: int) -> int:
    """The context length (tokens) a rollout engine is started with: ``max_prompt_length +
    max_response_length``, exactly what SGLang's request check needs (tokenizer_manager: a prompt shorter than
    the context, prompt + ``max_new_tokens`` within it) and no more, since SGLang refuses to start with a context
    longer than the model's (``max_position_embeddings``, checked at ``--cfg`` by rlhf.preflight)."""
    return int(max_prompt_length) + int(max_response_length)


def server_args_problems(given: Sequence[str], owned: Mapping[str, Mapping[str, str]]) -> List[str]:
    """The problems of the ``rollout.engine_kwargs.sglang`` keys ``given``, one line each: a key the rollout sets
    itself (``owned``: key -> ``{set: the config key that sets it}`` or ``{why: nothing may}``), or one that is not a
    field of SGLang's ServerArgs (with the nearest fields)."""
    import difflib

    from sglang.srt.server_args import ServerArgs  # a msgspec Struct in SGLang 0.5.2x, a dataclass before

    fields, out = list(getattr(ServerArgs, "__struct_fields__", None) or ServerArgs.__dataclass_fields__), []
    for k in given:
        key, owner = f"rollout.engine_kwargs.sglang.{k}", owned.get(k, {})
        if "why" in owner:
            out.append(f"{key} cannot be set here ({owner['why']}); drop it.")
        elif owner:
            out.append(f"{key} is set from the config here; set {owner['set']} instead.")
        elif k not in fields:
            near = difflib.get_close_matches(k, fields, n=3, cutoff=0.6)
            out.append(f"{key}: {k!r} is not a field of SGLang's ServerArgs (sglang.srt.server_args); "
                       + (f"did you mean {', '.join(near)}?" if near else "see python -m sglang.launch_server --help."))
    return out


def engine_kwargs(model_path: str, tp_size: int = 1, dtype: str = "auto", mem_fraction_static: Optional[float] = None,
                  context_length: Optional[int] = None, random_seed: int = 0, log_level: str = "warning",
                  device: Optional[str] = None, max_total_tokens: Optional[int] = None,
                  enable_memory_saver: Optional[bool] = None, **overrides: Any) -> Dict[str, Any]:
    """Keyword arguments of ``sglang.Engine`` for one rollout engine.

    Args:
        model_path: HF model directory (config, tokenizer, safetensors).
        tp_size: the engine's tensor-parallel size (independent of the trainer's TP).
        dtype: "auto" (SGLang's rule: checkpoint dtype, float32 run as float16), "float32", "bfloat16" or
            "float16"; the trainer passes :func:`resolve_engine_dtype` (its own dtype).
        mem_fraction_static: SGLang's share of device memory for weights + KV cache (None: SGLang's default).
        context_length: max prompt + response tokens (None: the model's max_position_embeddings).
        device: "cpu", "cuda" or None (CPU exactly when CUDA is unavailable); on CPU the settings of
            :mod:`rlhf.rollout.sglang_cpu` are added.
        max_total_tokens: KV-cache tokens, an upper bound on SGLang's profiled pool (None: on CPU 2048, on
            GPU SGLang's profile).
        enable_memory_saver: SGLang's memory saver (release/resume free memory); None: on with CUDA.
        overrides: more ``sglang.Engine`` arguments, applied last (``custom_weight_loader`` entries are kept and
            :data:`rlhf.rollout.engine_loader.LOADER` is added: the weight sync loads every bucket through it).
    Raises:
        ValueError: a bad value, named with the fix; on CPU also ``enable_torch_compile`` (SGLang's CPU engine
            compiles with inductor freezing whatever ``disable_cuda_graph`` says: weight syncs would not reach
            generation).
    """
    model_path = os.fspath(model_path)
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        raise ValueError(f"model_path {model_path!r} is not a HF model directory (no config.json)")
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be an int >= 1, got {tp_size!r}")
    if dtype != "auto" and dtype not in ENGINE_DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(ENGINE_DTYPES)}, got {dtype!r}")
    if mem_fraction_static is not None and not 0.0 < mem_fraction_static < 1.0:
        raise ValueError(f"mem_fraction_static must be in (0, 1), got {mem_fraction_static!r}")
    if context_length is not None and context_length < 2:
        raise ValueError(f"context_length must be >= 2, got {context_length!r}")
    on_cpu = sglang_cpu.use_cpu_engine(device)
    # sleep_on_idle: with no request queued the scheduler blocks on its request sockets (zmq poll, 1 s timeout)
    # instead of spinning through its idle housekeeping, which otherwise keeps a core busy while the trainer
    # computes (on CPU it is the trainer's core; on GPU a host core per engine).  Only the idle path changes: a
    # request wakes the poll at once (SGLang's IdleSleeper polls the request sockets themselves).
    # skip_tokenizer_init: token ids in, token ids and log-probs out (SGLang's RL mode): the engine loads no
    # tokenizer, detokenizes nothing per step, and its scheduler answers the tokenizer manager directly (no
    # detokenizer process: rlhf.rollout.sglang_engine.engine_class); the trainer decodes what its reward reads.
    kw: Dict[str, Any] = dict(model_path=model_path, tp_size=tp_size, dtype=dtype, random_seed=int(random_seed),
                              log_level=log_level, sleep_on_idle=True, skip_tokenizer_init=True)
    if mem_fraction_static is not None and not on_cpu:
        kw["mem_fraction_static"] = float(mem_fraction_static)
    if context_length is not None:
        kw["context_length"] = int(context_length)
    if on_cpu:
        kw.update(sglang_cpu.cpu_engine_kwargs(max_total_tokens or 2048))
    else:
        kw["enable_memory_saver"] = True if enable_memory_saver is None else bool(enable_memory_saver)
        if max_total_tokens is not None:
            kw["max_total_tokens"] = int(max_total_tokens)
    loaders = list(overrides.pop("custom_weight_loader", None) or [])
    kw.update(overrides)
    if on_cpu and kw.get("enable_torch_compile"):
        # SGLang's CPU engine compiles whenever enable_torch_compile is set, disable_cuda_graph or not
        # (model_runner_components/cuda_graph_setup.py), with inductor freezing (cpu_graph_runner.py,
        # set_torch_compile_config): the parameters become constants of the compiled graph, so no weight sync would
        # reach generation.
        raise ValueError("rollout engine_overrides enable_torch_compile=True on a CPU engine: SGLang's CPU engine "
                         "compiles with inductor freezing, which makes the parameters constants of the compiled "
                         "graph, so synced weights would never be used; drop enable_torch_compile on CPU")
    # our loader of the weight sync's buckets (rlhf.rollout.engine_loader: SGLang's loading, then a device wait)
    kw["custom_weight_loader"] = loaders + [LOADER] if LOADER not in loaders else loaders
    return kw


#: SGLang 0.5.23's switch of its TP memory balance check (sglang/srt/environ.py:500, read by
#: srt/distributed/bootstrap.py:_check_tp_memory_balance)
TP_MEMORY_CHECK_ENV = "SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK"
#: NCCL settings the trainer and its engines must share: SGLang 0.5.23 sets NCCL_CUMEM_ENABLE=0 in its processes
#: when it is unset (srt/entrypoints/engine.py:_set_envs_and_config), and communicators whose members differ in it
#: (the weight-update groups span trainer and engines) are a known weight-sync hang in peers
NCCL_SHARED_ENV = {"NCCL_CUMEM_ENABLE": "0"}


def share_nccl_env() -> None:
    """Give this process SGLang's NCCL settings (:data:`NCCL_SHARED_ENV`) where the user set none, before any NCCL
    communicator or engine starts; :func:`engine_env` hands the same values to the engines."""
    for key, value in NCCL_SHARED_ENV.items():
        os.environ.setdefault(key, value)


def engine_env(kwargs: Dict[str, Any], colocated: bool = False) -> Dict[str, str]:
    """Environment variables of the process that creates the engine (the Ray actor): on CPU the
    settings of :mod:`rlhf.rollout.sglang_cpu`; always this repository on PYTHONPATH (the actor
    imports ``rlhf``) and the trainer's NCCL settings (:data:`NCCL_SHARED_ENV`); for a ``colocated`` GPU
    engine of TP > 1, SGLang's TP memory balance check off (:data:`TP_MEMORY_CHECK_ENV` = ``"false"``).

    Why the check goes: before loading, each TP rank of an SGLang engine measures its GPU's free memory and
    raises "The memory capacity is unbalanced" when the least over the engine's ranks is under 0.9 x its own
    (sglang 0.5.23 ``srt/distributed/bootstrap.py:441-452``).  Colocated, the engine's GPUs hold trainer ranks
    whose memory differs by design: an engine spanning pipeline stages sees the first stage's embeddings (of the
    actor, the critic and the reference) on some GPUs and the LM / value heads on others, uneven stages more
    (Qwen2-7B at TP1 x PP2 x DP4 under one engine of TP 8: ~23 vs ~27 GiB free, docs/gpu.md D13).  SGLang sizes
    its static share from that least free memory anyway (``measure_pre_model_load_memory`` reduces it over the
    ranks), so the check only turns an expected imbalance into a refused start; with it off SGLang logs the same
    message as a warning.  Disaggregated engines own their GPUs: the check stays.  A CPU engine of TP > 1: off too
    (its ranks measure the same host memory, each at its own moment: on a shared machine other processes' memory
    moved by more than 10 % in between and refused a TP2 engine's start, tests/support/dist/family_sync_e2e.py)."""
    env: Dict[str, str] = {k: os.environ.get(k, v) for k, v in NCCL_SHARED_ENV.items()}  # the trainer's
    if kwargs.get("device") == "cpu":
        full = sglang_cpu.cpu_engine_env(int(kwargs.get("tp_size", 1)), base_env={})
        env.update(full)
        if int(kwargs.get("tp_size", 1)) > 1:  # every rank measures the same host memory, at another moment
            env[TP_MEMORY_CHECK_ENV] = "false"
    elif colocated and int(kwargs.get("tp_size", 1)) > 1:
        env[TP_MEMORY_CHECK_ENV] = "false"
    parts = [p for p in (env.get("PYTHONPATH", "") + os.pathsep + os.environ.get("PYTHONPATH", "")).split(os.pathsep)
             if p]
    if _REPO_ROOT not in parts:
        parts.append(_REPO_ROOT)
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    return env


def expected_weights_from_checkpoint(model_path: str, dtype: str = "auto"
                                     ) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
    """``{hf_name: (shape, dtype)}`` an engine started from ``model_path`` accepts in weight updates: the names
    and full shapes of the checkpoint's tensors (the model's ``load_weights`` was built from them; tied models
    list no ``lm_head.weight``), with the dtype the engine computes in for floating tensors: SGLang's own rule
    for ``dtype="auto"`` (config.json's dtype, except that float32 checkpoints run in float16).

    Raises:
        FileNotFoundError: no safetensors file in ``model_path``.
    """
    from parallel.convert.hf_io import read_checkpoint_metadata

    engine_dtype = engine_compute_dtype(model_path, dtype)
    return {n: (shape, engine_dtype if dt.is_floating_point else dt)
            for n, (shape, dt) in read_checkpoint_metadata(model_path).items()}


def engine_compute_dtype(model_path: str, dtype: str = "auto") -> torch.dtype:
    """The dtype SGLang runs the model in (its ``_get_and_verify_dtype`` on config.json).  A dtype given by name
    is that dtype (SGLang's rule too), found without importing SGLang: the trainer starts its engines with it
    (``rollout.dtype=auto`` resolves to ``model.dtype``), and an import of SGLang there would delay every
    engine's start by SGLang's import time."""
    import json

    if dtype != "auto" and str(dtype).lower() in ENGINE_DTYPES:
        return ENGINE_DTYPES[str(dtype).lower()]
    from sglang.srt.configs.model_config import _get_and_verify_dtype

    with open(os.path.join(model_path, "config.json")) as f:
        return _get_and_verify_dtype(json.load(f), dtype)
