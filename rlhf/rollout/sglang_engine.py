"""SGLangEngine: one ``sglang.Engine`` owned by the process of a Ray actor.

The actor is the isolation boundary.  SGLang's scheduler processes are children of this process
(they SIGKILL themselves when it dies, PR_SET_PDEATHSIG); when one of them fails, SGLang's SIGQUIT
handler kills this process tree, Ray reports the actor dead (``RayActorError``) and
:class:`rlhf.rollout.manager.RolloutManager` restarts it.  Nothing else wraps the engine: methods
carry SGLang's names and arguments, and only plain data crosses Ray (token ids, sampling
parameters, metadata and, for weight updates, the serialized bytes of a ``FlattenedTensorBucket``
whose memory stays with the trainer process that owns it).

Used as ``ray.remote(SGLangEngine).options(...).remote(engine_kwargs, index)`` by the manager; the
CPU settings (env vars, stand-in ``sgl_kernel``) reach the actor through its ``runtime_env``
(:mod:`rlhf.rollout.sglang_cpu`).
"""
from __future__ import annotations

import functools
import json
import os
import time
from typing import Any, Dict, List, Optional, Sequence

from rlhf import faults
from rlhf.rollout.sampling import SamplingConfig
from rlhf.rollout.types import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, RolloutSample

__all__ = ["SGLangEngine", "EngineCallError", "check_result", "engine_class"]

#: tags of SGLang's memory saver (``release_memory_occupation(tags)``)
MEMORY_TAGS = ("weights", "kv_cache")
#: what an aborted request looks like (RLHF_FAULT=rollout_request_error@<k>, rlhf.faults)
_INJECTED_ABORT = {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": "injected"},
                                                   "output_token_logprobs": []}}


@functools.lru_cache(maxsize=None)
def engine_class(skip_tokenizer_init: bool, fork_schedulers: bool = False):
    """``sglang.Engine``, or its subclass for the options:

    * ``skip_tokenizer_init`` (token ids in and out, no text): no detokenizer process is started; in that mode
      the scheduler sends its outputs straight to the tokenizer manager (SGLang's ``SchedulerIpcChannels`` binds
      ``send_to_detokenizer`` to the tokenizer's socket), so a detokenizer would only hold another copy of
      SGLang's imports (~0.7 GB) and cost a start-up;
    * ``fork_schedulers`` (CPU engines, :func:`rlhf.rollout.sglang_cpu.forked_subprocesses`): the scheduler
      processes are forked from this one instead of spawned.
    """
    from sglang.srt.entrypoints.engine import Engine

    if not skip_tokenizer_init and not fork_schedulers:
        return Engine

    class RolloutEngine(Engine):
        @classmethod
        def _launch_scheduler_processes(cls, *args, **kwargs):
            if not fork_schedulers:
                return super()._launch_scheduler_processes(*args, **kwargs)
            from rlhf.rollout.sglang_cpu import forked_subprocesses

            with forked_subprocesses():
                return super()._launch_scheduler_processes(*args, **kwargs)

        @classmethod
        def _launch_detokenizer_subprocesses(cls, server_args, port_args, run_detokenizer_process_func):
            if not skip_tokenizer_init:
                return super()._launch_detokenizer_subprocesses(server_args, port_args, run_detokenizer_process_func)
            return [], []  # (processes, names) for SGLang's subprocess watchdog: none

    return RolloutEngine


class EngineCallError(RuntimeError):
    """SGLang refused or failed a request on a live engine (the message says which and why)."""


def routing_shape(model_path: str) -> tuple:
    """(layers, experts per token) of the MoE model at `model_path` (its config.json: ``num_hidden_layers``,
    ``num_experts_per_tok``), the shape of SGLang's returned routing (its RoutedExpertsCapturer)."""
    with open(os.path.join(model_path, "config.json")) as f:
        c = json.load(f)
    c = c.get("text_config", c)
    return int(c["num_hidden_layers"]), int(c["num_experts_per_tok"])


def decode_routed_experts(value: Any, shape: tuple):
    """SGLang's ``meta_info["routed_experts"]`` (base64 of int32 [tokens, layers, top-k], or that array) as a numpy
    int32 array [tokens, layers, top-k]: one row per token the engine ran, the prompt's and the response's but
    the last response token (never fed back).  Raises EngineCallError for a size that does not split so."""
    import numpy as np
    import pybase64

    raw = value if not isinstance(value, str) else np.frombuffer(bytearray(pybase64.b64decode(value.encode())), dtype=np.int32)  # writable: torch takes it
    arr = np.asarray(raw, dtype=np.int32).reshape(-1)
    per_token = shape[0] * shape[1]
    if arr.size % per_token:
        raise EngineCallError(f"routed_experts: {arr.size} values are not tokens x {shape[0]} layers x {shape[1]}")
    return arr.reshape(-1, *shape)


def check_result(result: Any, what: str) -> Any:
    """Raise EngineCallError when an SGLang control call reports failure.

    SGLang returns ``(success, message, ...)`` tuples, objects with ``.success``, or None.
    Returns ``result`` unchanged when it reports success.
    """
    if isinstance(result, tuple) and result and isinstance(result[0], bool):
        if not result[0]:
            raise EngineCallError(f"{what} failed: {result[1] if len(result) > 1 else ''}")
    elif getattr(result, "success", None) is False:
        msg = getattr(result, "message", None) or getattr(result, "error_message", "")
        raise EngineCallError(f"{what} failed: {msg}")
    return result


class SGLangEngine:
    """Body of the Ray actor that owns one SGLang engine (see module docstring).

    Args:
        engine_kwargs: ``sglang.Engine`` keyword arguments (``model_path`` and ``tp_size`` required);
            see :func:`rlhf.rollout.engine_args.engine_kwargs`.
        engine_index: position of this engine in its manager (logs, sample metadata).
        expected_weights: ``{hf_name: (shape, dtype)}`` the engine accepts in weight updates (computed
            once by the manager from the checkpoint's headers).
    Raises:
        whatever ``sglang.Engine`` raises when it cannot start (the actor creation then fails).
    """

    lora_name: Optional[str] = None  # the LoRA adapter every generation uses (load_lora_adapter)
    _routing_shape = None  # (layers, top-k) when the engine returns each token's routed experts (R3)

    def __init__(self, engine_kwargs: Dict[str, Any], engine_index: int = 0,
                 expected_weights: Optional[Dict[str, Any]] = None):
        t0 = time.time()
        self.index = int(engine_index)
        self.tp_size = int(engine_kwargs.get("tp_size", 1))
        self.engine = engine_class(bool(engine_kwargs.get("skip_tokenizer_init")),
                                   fork_schedulers=engine_kwargs.get("device") == "cpu")(**engine_kwargs)
        # Everything alive after start-up (SGLang's modules, the model, the pools: ~1M objects) leaves the
        # collector's view in this process and the schedulers (SGLang's freeze_gc): each release of the KV cache
        # runs SGLang's flush_cache, which on CPU is a full gc.collect(), and would otherwise walk them all again.
        self.engine.freeze_gc()
        self.startup_seconds = time.time() - t0
        self._expected = dict(expected_weights or {})
        self.weight_version = 0
        self._in_update = False
        self._updated = False
        self._released: set = set()  # memory-saver tags this engine has released
        # MoE routing replay (R3): SGLang returns each token's routed experts; (layers, top-k) to shape them
        self._routing_shape = routing_shape(engine_kwargs["model_path"]) \
            if engine_kwargs.get("enable_return_routed_experts") else None

    # ------------------------------------------------------------------ state
    def info(self) -> Dict[str, Any]:
        """``{"pid", "index", "tp_size", "startup_seconds", "weight_version"}`` (answers once started)."""
        return {"pid": os.getpid(), "index": self.index, "tp_size": self.tp_size,
                "startup_seconds": self.startup_seconds, "weight_version": self.weight_version}

    def expected_weights(self) -> Dict[str, Any]:
        """``{hf_name: (full shape, dtype)}`` this engine loads (unsharded: SGLang slices per TP rank)."""
        return dict(self._expected)

    # ------------------------------------------------------------------ generation
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingConfig) -> List[RolloutSample]:
        """``sampling.n`` responses per prompt, prompt-major, with SGLang's per-token log-probs.

        Args:
            prompt_token_ids: P non-empty lists of token ids.
        Returns:
            ``P * n`` :class:`RolloutSample` (``prompt_index`` relative to this call).
        Raises:
            ValueError: an empty or non-integer prompt. EngineCallError: SGLang returned inconsistent output.
        """
        sampling.validate()
        prompts = [list(p) for p in prompt_token_ids]
        for i, p in enumerate(prompts):
            if not p or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p):
                raise ValueError(f"prompt {i} must be a non-empty list of non-negative int token ids, got {p[:8]!r}")
        if not prompts:
            return []
        n = sampling.n
        index = [(i, j) for i in range(len(prompts)) for j in range(n)]
        params = [sampling.to_sglang(None if sampling.seed is None else sampling.seed + i * n + j) for i, j in index]
        lora = None if self.lora_name is None else [self.lora_name] * len(index)
        outs = self.engine.generate(input_ids=[prompts[i] for i, _ in index], sampling_params=params,
                                    return_logprob=True, lora_path=lora,
                                    **({"return_routed_experts": True} if self._routing_shape else {}))
        outs = [outs] if isinstance(outs, dict) else outs
        outs = [_INJECTED_ABORT if faults.fires("rollout_request_error") else o for o in outs]  # fault injection
        return [self._sample(o, prompts[i], i, j) for (i, j), o in zip(index, outs)]

    def _sample(self, out: dict, prompt: List[int], i: int, j: int) -> RolloutSample:
        meta = out["meta_info"]
        lps = meta.get("output_token_logprobs") or []
        ids = out.get("output_ids")
        ids = [int(t[1]) for t in lps] if ids is None else [int(t) for t in ids]
        if len(lps) != len(ids):
            raise EngineCallError(f"generate: {len(ids)} tokens but {len(lps)} log-probs (prompt {i}, sample {j})")
        fr = meta.get("finish_reason") or {}
        ftype = fr.get("type") if isinstance(fr, dict) else str(fr)
        reason = {"stop": FINISH_STOP, "length": FINISH_LENGTH}.get(ftype, FINISH_ABORT)
        extra = {"finish_detail": fr}
        if self._routing_shape and meta.get("routed_experts") is not None:
            extra["routed_experts"] = decode_routed_experts(meta["routed_experts"], self._routing_shape)
        return RolloutSample(prompt_ids=prompt, response_ids=ids, response_log_probs=[float(t[0]) for t in lps],
                             finish_reason=reason, prompt_index=i, sample_index=j,
                             weight_version=self.weight_version, extra=extra)

    # ------------------------------------------------------------------ weights
    def begin_weight_update(self) -> None:
        """Open a weight-update session (SGLang >= 0.5.23 requires one around tensor/distributed updates)."""
        check_result(self.engine.begin_weight_update(), "begin_weight_update")
        self._in_update, self._updated = True, False

    def end_weight_update(self) -> int:
        """Close the session; returns the weight version (bumped when anything was loaded in it).

        Raises:
            EngineCallError: SGLang refused (its only refusal: no session open there).  The session counts as
                closed here too, so the next sync opens a fresh one instead of loading into none and failing
                every sync after; the version is not bumped (the sync that raised is reported failed).
        """
        try:
            check_result(self.engine.end_weight_update(), "end_weight_update")
        finally:
            updated, self._in_update, self._updated = self._updated, False, False
        if updated:
            self.weight_version += 1
        return self.weight_version

    def _require_session(self, what: str) -> None:
        if not self._in_update:
            raise EngineCallError(f"{what} must run between begin_weight_update() and end_weight_update()")

    def update_weights_from_tensor(self, serialized_named_tensors: List[bytes], load_format: str = "flattened_bucket",
                                   flush_cache: bool = False) -> None:
        """Load one bucket: ``serialized_named_tensors[r]`` is TP rank r's serialized
        ``{"flattened_tensor", "metadata"}`` (SGLang's FlattenedTensorBucket), whose memory (CPU shared
        memory or CUDA IPC) belongs to the trainer process that serialized it.

        ``load_format="flattened_bucket"`` runs through our custom loader's ``bucket`` operation
        (rlhf.rollout.engine_loader.load_bucket): SGLang's own ``load_weights`` on the bucket, then each TP rank
        waits for its device, so when this returns no copy still reads the sender's buffer (SGLang's
        ``flattened_bucket`` replies with the copies possibly still queued; the sender reuses its buffers).
        Another ``load_format`` goes to SGLang as it is.

        Raises:
            EngineCallError: outside a session, wrong payload count, or SGLang's failure.
        """
        from rlhf.rollout.engine_loader import LOADER, bucket_header

        self._require_session("update_weights_from_tensor")
        if len(serialized_named_tensors) != self.tp_size:
            raise EngineCallError(f"update_weights_from_tensor: {len(serialized_named_tensors)} payloads for "
                                  f"tp_size={self.tp_size} (one per TP rank)")
        named: List[Any] = list(serialized_named_tensors)
        if load_format == "flattened_bucket":
            import torch

            named, load_format = [(bucket_header(named, last=flush_cache), torch.empty(0))], LOADER
        check_result(self.engine.update_weights_from_tensor(named_tensors=named, load_format=load_format,
                                                            flush_cache=flush_cache), "update_weights_from_tensor")
        self._updated = True

    def update_weights_from_disk(self, model_path: str) -> int:
        """Reload every weight from an HF checkpoint directory; returns the new weight version."""
        check_result(self.engine.update_weights_from_disk(model_path), "update_weights_from_disk")
        self.weight_version += 1
        return self.weight_version

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str = "nccl") -> None:
        """Join the weight-update group ``group_name`` (ranks rank_offset..rank_offset+tp-1; blocks until
        every member, the trainer's sender included, joined)."""
        check_result(self.engine.init_weights_update_group(master_address=master_address, master_port=master_port,
                                                           rank_offset=rank_offset, world_size=world_size,
                                                           group_name=group_name, backend=backend),
                     f"init_weights_update_group({group_name})")

    def update_weights_from_distributed(self, names: List[str], dtypes: List[str], shapes: List[List[int]],
                                        group_name: str, flush_cache: bool = False,
                                        load_format: Optional[str] = "flattened_bucket") -> None:
        """Receive one bucket broadcast by rank 0 of ``group_name`` (one flat message with
        ``load_format="flattened_bucket"``) and load it.  Names and shapes are checked against
        :meth:`expected_weights` first (SGLang ignores unknown names and crashes on wrong shapes).

        Raises:
            EngineCallError: outside a session, unknown names / wrong shapes, or SGLang's failure.
        """
        self._require_session("update_weights_from_distributed")
        if self._expected:
            bad = [f"{n} {tuple(s)}" for n, s in zip(names, shapes)
                   if n not in self._expected or tuple(self._expected[n][0]) != tuple(s)]
            if bad:
                raise EngineCallError(f"update_weights_from_distributed: unknown names or wrong shapes {bad[:5]}")
        check_result(self.engine.update_weights_from_distributed(names=list(names), dtypes=list(dtypes),
                                                                 shapes=[list(s) for s in shapes],
                                                                 group_name=group_name, flush_cache=flush_cache,
                                                                 load_format=load_format),
                     "update_weights_from_distributed")
        self._updated = True

    def load_lora_adapter(self, tensors: Dict[str, Any], config: Dict[str, Any]) -> int:
        """Load a LoRA adapter through SGLang's ``load_lora_adapter_from_tensors`` (``tensors``: ``{PEFT name:
        CPU tensor}``, ``base_model.model.<module>.lora_A.weight`` [r, in] / ``lora_B.weight`` [out, r] as PEFT
        writes them; SGLang slices them per TP rank; ``config``: PEFT's adapter_config), unload the previous one;
        every later :meth:`generate` passes it as ``lora_path``.  Needs an engine started with ``enable_lora``.
        Returns the new weight version.  Raises EngineCallError when SGLang refuses."""
        name = f"actor_v{self.weight_version + 1}"
        check_result(self.engine.load_lora_adapter_from_tensors(name, dict(tensors), dict(config)),
                     "load_lora_adapter_from_tensors")
        old, self.lora_name = self.lora_name, name
        if old is not None:
            check_result(self.engine.unload_lora_adapter(old), "unload_lora_adapter")
        self.weight_version += 1
        return self.weight_version

    def engine_parameters(self) -> List[Dict[str, Any]]:
        """Every parameter of every TP rank (engine names; CPU copies, the whole model: tests, diagnostics), through
        our custom loader's ``dump`` (rlhf.rollout.engine_loader), which writes one file per TP rank (the schedulers
        are this actor's children, on this host; the scheduler has no other way to return data)."""
        import json
        import tempfile

        import torch

        from rlhf.rollout.engine_loader import LOADER

        with tempfile.TemporaryDirectory(prefix=f"rlhf_engine{self.index}_") as d:
            out = os.path.join(d, "dump")
            opened = not self._in_update
            if opened:
                check_result(self.engine.begin_weight_update(), "begin_weight_update")
            try:
                check_result(self.engine.update_weights_from_tensor(
                    named_tensors=[(json.dumps({"op": "dump", "out": out}), torch.empty(0))], load_format=LOADER),
                    "engine_parameters")
            finally:
                if opened:
                    check_result(self.engine.end_weight_update(), "end_weight_update")
            files = [f"{out}.rank{r}.pt" for r in range(self.tp_size)]
            missing = [f for f in files if not os.path.exists(f)]
            if missing:
                raise EngineCallError(f"engine_parameters: no result from TP ranks {missing} (engine TP ranks on "
                                      f"another host?)")
            return [torch.load(f, weights_only=False) for f in files]

    def destroy_weights_update_group(self, group_name: str) -> None:
        check_result(self.engine.destroy_weights_update_group(group_name), "destroy_weights_update_group")

    def get_weights_by_name(self, name: str, truncate_size: int = 100):
        """TP rank 0's copy of parameter ``name`` (SGLang name), first ``truncate_size`` rows, as lists."""
        return self.engine.get_weights_by_name(name, truncate_size=truncate_size)

    def flush_cache(self) -> None:
        """Drop the prefix (radix) cache."""
        check_result(self.engine.flush_cache(), "flush_cache")

    # ------------------------------------------------------------------ memory (colocated)
    def release_memory_occupation(self, tags: Optional[List[str]] = None) -> None:
        """Free ``tags`` (default: weights and KV cache); tags already released are skipped.  A no-op for
        memory on CPU, where SGLang's memory saver is disabled, but the same calls run."""
        todo = [t for t in (tags or MEMORY_TAGS) if t not in self._released]
        if todo:
            check_result(self.engine.release_memory_occupation(tags=todo), "release_memory_occupation")
            self._released |= set(todo)

    def resume_memory_occupation(self, tags: Optional[List[str]] = None) -> None:
        """Re-allocate ``tags`` (default: all) freed by :meth:`release_memory_occupation`.

        Raises:
            EngineCallError: a tag this engine did not release; nothing reaches SGLang, whose scheduler dies
                on such a resume (the engine would be lost and replaced, hiding the caller's mistake).
        """
        tags = list(tags or MEMORY_TAGS)
        held = [t for t in tags if t not in self._released]
        if held:
            raise EngineCallError(f"resume_memory_occupation({tags}): engine {self.index} has not released {held} "
                                  f"(released: {sorted(self._released)}); resume only what was released")
        check_result(self.engine.resume_memory_occupation(tags=tags), "resume_memory_occupation")
        self._released -= set(tags)

    def shutdown(self) -> None:
        """Stop the engine and its scheduler processes (the actor is killed by the manager after)."""
        try:
            self.engine.shutdown()
        except Exception:  # noqa: BLE001 - best effort, the process is about to be killed
            pass
