"""One SGLang engine in its own child process.

Why a child process: SGLang's scheduler processes send SIGQUIT to the process that created
``sglang.Engine`` when they fail (e.g. a weight update with a wrong shape), and that process then
SIGKILLs its whole process tree, itself included. :class:`RolloutEngine` therefore creates the engine in
a separate ``python -m rlhf.rollout.engine`` process (its own session / process group) and talks to it
over a socket pair with :mod:`multiprocessing.connection` framing. If the child dies, every call raises
:class:`EngineDiedError`; the caller lives on and may :meth:`RolloutEngine.restart`.

Tensors sent to the child (``update_weights_from_tensor``) travel with torch's multiprocessing pickler:
CPU tensors are moved to shared memory and their file descriptors passed (the child is given this
process's multiprocessing authkey so it may fetch them); CUDA tensors travel as CUDA IPC handles. Nothing
is copied through the socket but metadata.

All methods are synchronous and thread-safe (one request at a time per engine). The exceptions are the
``*_async`` variants, which return a :class:`PendingCall` immediately so the caller can take part in a
collective (the trainer's broadcast) while the engine receives; the next call on the engine waits for the
pending one first.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from rlhf.rollout import sglang_cpu
from rlhf.rollout.sampling import SamplingConfig
from rlhf.rollout.types import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, RolloutSample

__all__ = [
    "RolloutEngine",
    "PendingCall",
    "EngineDiedError",
    "EngineCallError",
    "read_checkpoint_weights",
]

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_ENGINE_DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16,
                  "half": torch.float16, "bfloat16": torch.bfloat16}


class EngineDiedError(RuntimeError):
    """The engine's child process is gone (crashed, killed, or shut down); restart it to continue."""


class EngineCallError(RuntimeError):
    """SGLang raised or reported failure inside a live engine; ``remote_traceback`` holds the child's traceback."""

    def __init__(self, message: str, remote_traceback: str = ""):
        super().__init__(message)
        self.remote_traceback = remote_traceback

    def __reduce__(self):  # keep the traceback when pickled (e.g. through Ray)
        return (EngineCallError, (self.args[0], self.remote_traceback))


def read_checkpoint_weights(model_path: str) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
    """Names, shapes and dtypes of all tensors in a HF checkpoint's safetensors files (headers only).

    Args:
        model_path: a HF model directory with ``model.safetensors`` or ``model.safetensors.index.json`` shards.
    Returns:
        ``{hf_name: (shape, dtype)}``.
    Raises:
        FileNotFoundError: no safetensors file in ``model_path``.
    """
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(model_path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors checkpoint in {model_path!r}")
    out: Dict[str, Tuple[Tuple[int, ...], torch.dtype]] = {}
    for fname in files:
        with open(os.path.join(model_path, fname), "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            out[name] = (tuple(int(s) for s in info["shape"]), _SAFETENSORS_DTYPES.get(info["dtype"], torch.float32))
    return out


class PendingCall:
    """Handle of a request sent with an ``*_async`` method. :meth:`wait` returns its result or raises."""

    def __init__(self, engine: "RolloutEngine", method: str):
        self._engine = engine
        self.method = method
        self._done = False
        self._result: Any = None
        self._error: Optional[BaseException] = None

    def _resolve(self) -> None:
        # called with the engine lock held
        if self._done:
            return
        try:
            self._result = self._engine._recv_reply(self.method)
        except BaseException as e:  # noqa: BLE001 - re-raised from wait()
            self._error = e
        self._done = True
        if self._engine._pending is self:
            self._engine._pending = None

    def done(self) -> bool:
        return self._done

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Block until the engine answered (``timeout`` seconds at most; None = no limit).

        Raises:
            TimeoutError: no answer within ``timeout`` (the request stays pending).
            EngineDiedError / EngineCallError: as the synchronous method would.
        """
        with self._engine._lock:
            if not self._done:
                if timeout is not None and not self._engine._poll(timeout):
                    raise TimeoutError(f"{self.method}: no answer from the engine within {timeout} s")
                self._resolve()
        if self._error is not None:
            raise self._error
        return self._result


class RolloutEngine:
    """A ``sglang.Engine`` running in its own child process.

    Args:
        model_path: HF model directory (config, tokenizer, safetensors).
        tp_size: SGLang tensor-parallel size of this engine (independent of the trainer's TP).
        dtype: engine dtype: "auto" (checkpoint dtype), "float32", "bfloat16", "float16".
        mem_fraction_static: SGLang's fraction of device memory for weights + KV cache (None = SGLang default).
        context_length: max prompt + response tokens (None = the model's max_position_embeddings).
        random_seed: engine sampling seed.
        log_level: SGLang log level ("error", "warning", "info", ...).
        device: "cpu", "cuda", or None (CPU exactly when CUDA is unavailable). On CPU the settings of
            :mod:`rlhf.rollout.sglang_cpu` are applied (env vars, stand-in ``sgl_kernel``, engine kwargs).
        max_total_tokens: KV-cache size in tokens on CPU (None = SGLang's own sizing; on CPU 2048).
        engine_overrides: more ``sglang.Engine`` keyword arguments, applied last.
        startup_timeout: seconds to wait for the engine to become ready.
        start: start the child now (else call :meth:`start`).

    Raises:
        ValueError: bad argument values (named in the message).
        EngineDiedError: the child failed to start (its stderr is inherited, so SGLang's error is printed).
    """

    def __init__(self, model_path: str, tp_size: int = 1, dtype: str = "auto",
                 mem_fraction_static: Optional[float] = None, context_length: Optional[int] = None,
                 random_seed: int = 0, log_level: str = "warning", device: Optional[str] = None,
                 max_total_tokens: Optional[int] = None, engine_overrides: Optional[Dict[str, Any]] = None,
                 startup_timeout: float = 600.0, start: bool = True):
        model_path = os.fspath(model_path)
        if not os.path.isfile(os.path.join(model_path, "config.json")):
            raise ValueError(f"model_path {model_path!r} is not a HF model directory (no config.json)")
        if not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tp_size must be an int >= 1, got {tp_size!r}")
        if dtype != "auto" and dtype not in _ENGINE_DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_ENGINE_DTYPES)}, got {dtype!r}")
        if mem_fraction_static is not None and not 0.0 < mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {mem_fraction_static!r}")
        if context_length is not None and context_length < 2:
            raise ValueError(f"context_length must be >= 2, got {context_length!r}")
        self.model_path = model_path
        self.tp_size = tp_size
        self.dtype = dtype
        self.on_cpu = sglang_cpu.use_cpu_engine(device)
        self.startup_timeout = float(startup_timeout)
        kwargs: Dict[str, Any] = dict(model_path=model_path, tp_size=tp_size, dtype=dtype,
                                      random_seed=int(random_seed), log_level=log_level)
        if mem_fraction_static is not None:
            kwargs["mem_fraction_static"] = float(mem_fraction_static)
        if context_length is not None:
            kwargs["context_length"] = int(context_length)
        if self.on_cpu:
            kwargs.update(sglang_cpu.cpu_engine_kwargs(max_total_tokens or 2048))
        elif max_total_tokens is not None:
            kwargs["max_total_tokens"] = int(max_total_tokens)
        kwargs.update(engine_overrides or {})
        self.engine_kwargs = kwargs
        ckpt = read_checkpoint_weights(model_path)
        engine_dtype = _ENGINE_DTYPES.get(dtype)
        self._expected = {n: (shape, engine_dtype if (engine_dtype is not None and dt.is_floating_point) else dt)
                          for n, (shape, dt) in ckpt.items()}
        self._lock = threading.RLock()
        self._proc: Optional[subprocess.Popen] = None
        self._conn: Optional[multiprocessing.connection.Connection] = None
        self._pending: Optional[PendingCall] = None
        self._dead_reason: Optional[str] = "not started"
        self._in_update = False
        self._updated_in_session = False
        self.weight_version = 0
        self.startup_seconds: Optional[float] = None
        if start:
            self.start()

    # ------------------------------------------------------------------ process management
    def start(self) -> None:
        """Start the child process and wait until its engine is ready (no-op when alive).

        Raises:
            EngineDiedError: the child exited or did not become ready within ``startup_timeout``.
        """
        with self._lock:
            if self.is_alive():
                return
            self._cleanup_process()
            t0 = time.time()
            env = sglang_cpu.cpu_engine_env(self.tp_size) if self.on_cpu else dict(os.environ)
            parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
            if _REPO_ROOT not in parts:
                parts.append(_REPO_ROOT)
            env["PYTHONPATH"] = os.pathsep.join(parts)
            parent_sock, child_sock = socket.socketpair()
            try:
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "rlhf.rollout.engine", "--fd", str(child_sock.fileno())],
                    pass_fds=[child_sock.fileno()], env=env, start_new_session=True, stdin=subprocess.DEVNULL)
            finally:
                child_sock.close()
            self._conn = multiprocessing.connection.Connection(parent_sock.detach())
            self._dead_reason = None
            self._in_update = False
            self._updated_in_session = False
            self.weight_version = 0
            self._conn.send({"engine_kwargs": self.engine_kwargs,
                             "authkey": bytes(multiprocessing.current_process().authkey)})
            if not self._poll(self.startup_timeout):
                self._mark_dead(f"engine did not become ready within {self.startup_timeout} s")
                raise EngineDiedError(self._dead_reason)
            info = self._recv_reply("start")
            self.startup_seconds = time.time() - t0
            self.child_info = info

    def _cleanup_process(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except OSError:
                pass
            self._conn = None
        if self._proc is not None:
            if self._proc.poll() is None:
                # the child leads its own process group: this reaches the SGLang scheduler/detokenizer too
                try:
                    os.killpg(self._proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            # SGLang children that outlived the child are in the same process group
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def _mark_dead(self, reason: str) -> None:
        self._dead_reason = reason
        self._pending = None
        self._cleanup_process()

    @property
    def pid(self) -> Optional[int]:
        """Process id of the child that owns the SGLang engine (None before start)."""
        return self._proc.pid if self._proc is not None else None

    def is_alive(self) -> bool:
        """True when the child process is running and has not been declared dead."""
        return self._dead_reason is None and self._proc is not None and self._proc.poll() is None

    def restart(self) -> None:
        """Shut down (or reap) the current child and start a fresh one with the checkpoint in ``model_path``.

        ``weight_version`` returns to 0: push the latest weights again after a restart.
        """
        with self._lock:
            self.shutdown()
            self.start()

    def shutdown(self, timeout: float = 60.0) -> None:
        """Stop the engine and its child process (idempotent)."""
        with self._lock:
            if self._proc is None:
                return
            if self.is_alive() and self._conn is not None:
                try:
                    if self._pending is not None:
                        self._pending._resolve()
                    self._conn.send(("shutdown", (), {}))
                    if self._poll(timeout):
                        self._conn.recv()
                    self._proc.wait(timeout=timeout)
                except (OSError, EOFError, subprocess.TimeoutExpired, EngineDiedError, EngineCallError):
                    pass
            self._mark_dead("shut down")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
        return False

    def __del__(self):
        try:
            if self._proc is not None and self._proc.poll() is None:
                self._mark_dead("garbage collected")
        except Exception:
            pass

    # ------------------------------------------------------------------ transport
    def _poll(self, timeout: Optional[float]) -> bool:
        """Wait for data from the child; False on timeout. Raises EngineDiedError if the child died."""
        deadline = None if timeout is None else time.time() + timeout
        while True:
            if self._conn is None:
                raise EngineDiedError(f"engine is dead: {self._dead_reason}")
            step = 0.5 if deadline is None else max(0.0, min(0.5, deadline - time.time()))
            try:
                if self._conn.poll(step):
                    return True
            except (OSError, EOFError):
                return True  # recv() will report the death
            if self._proc is not None and self._proc.poll() is not None:
                if self._conn.poll(0):
                    return True
                code = self._proc.returncode
                self._mark_dead(f"engine process {self._proc.pid} exited with code {code}")
                raise EngineDiedError(self._dead_reason)
            if deadline is not None and time.time() >= deadline:
                return False

    def _recv_reply(self, method: str) -> Any:
        if self._conn is None:
            raise EngineDiedError(f"engine is dead: {self._dead_reason}")
        self._poll(None)
        try:
            msg = self._conn.recv()
        except (EOFError, OSError, ConnectionError) as e:
            code = self._proc.poll() if self._proc is not None else None
            self._mark_dead(f"engine process died during {method!r} (exit code {code}): {type(e).__name__}")
            raise EngineDiedError(self._dead_reason) from None
        kind = msg[0]
        if kind == "ok":
            return msg[1]
        if kind == "err":
            _, etype, text, tb = msg
            raise EngineCallError(f"{method}: {etype}: {text}", tb)
        raise EngineCallError(f"{method}: unexpected reply {kind!r} from the engine process")

    def _send(self, method: str, args: tuple, kwargs: dict) -> None:
        if self._pending is not None:
            self._pending._resolve()
        if not self.is_alive() or self._conn is None:
            if self._dead_reason is None and self._proc is not None:
                self._mark_dead(f"engine process {self._proc.pid} exited with code {self._proc.returncode}")
            raise EngineDiedError(f"engine is dead: {self._dead_reason}")
        try:
            self._conn.send((method, args, kwargs))
        except (OSError, EOFError, ConnectionError) as e:
            self._mark_dead(f"engine process unreachable during {method!r}: {type(e).__name__}")
            raise EngineDiedError(self._dead_reason) from None

    def _call(self, method: str, *args, **kwargs) -> Any:
        with self._lock:
            self._send(method, args, kwargs)
            return self._recv_reply(method)

    def _call_async(self, method: str, *args, **kwargs) -> PendingCall:
        with self._lock:
            self._send(method, args, kwargs)
            handle = PendingCall(self, method)
            self._pending = handle
            return handle

    # ------------------------------------------------------------------ generation
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingConfig) -> List[RolloutSample]:
        """Generate ``sampling.n`` responses for every prompt.

        Args:
            prompt_token_ids: P prompts, each a non-empty list of token ids.
            sampling: see :class:`SamplingConfig`.
        Returns:
            ``P * n`` samples ordered prompt-major (prompt 0 samples 0..n-1, prompt 1, ...), each with per-token
            log-probs (SGLang's ``output_token_logprobs``).
        Raises:
            ValueError: empty / non-integer prompts. EngineDiedError: the engine process died.
            EngineCallError: SGLang rejected the request (e.g. prompt longer than the context).
        """
        if not isinstance(sampling, SamplingConfig):
            raise ValueError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
        sampling.validate()
        prompts = [list(p) for p in prompt_token_ids]
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p):
                raise ValueError(f"prompt {i} must hold non-negative int token ids, got {p[:8]!r}...")
        if not prompts:
            return []
        n = sampling.n
        index = [(i, j) for i in range(len(prompts)) for j in range(n)]
        params = [sampling.to_sglang(None if sampling.seed is None else sampling.seed + i * n + j) for i, j in index]
        outs = self._call("generate", [prompts[i] for i, _ in index], params)
        samples = []
        version = self.weight_version
        for (i, j), o in zip(index, outs):
            ids, lps, ftype = o["output_ids"], o["logprobs"], o["finish_type"]
            if len(lps) != len(ids):
                raise EngineCallError(f"generate: {len(ids)} tokens but {len(lps)} log-probs for prompt {i} sample {j}")
            reason = {"stop": FINISH_STOP, "length": FINISH_LENGTH}.get(ftype, FINISH_ABORT)
            samples.append(RolloutSample(prompt_ids=prompts[i], response_ids=list(ids),
                                         response_log_probs=[float(x) for x in lps], finish_reason=reason,
                                         prompt_index=i, sample_index=j, weight_version=version,
                                         extra={"finish_detail": o.get("finish_detail")}))
        return samples

    # ------------------------------------------------------------------ weights
    def expected_weights(self) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
        """HF-named tensors this engine accepts in weight updates: ``{name: (shape, dtype)}``.

        Derived from the safetensors headers of ``model_path`` (the names and shapes the model's
        ``load_weights`` was built from): full, unsharded HF shapes, whatever ``tp_size`` is (each rank slices
        its part). Tied models list no ``lm_head.weight``. dtype is the engine dtype for floating tensors
        (the checkpoint's when ``dtype="auto"``); updates in another float dtype are cast by the loader.
        """
        return dict(self._expected)

    def validate_named_tensors(self, names: Sequence[str], shapes: Sequence[Sequence[int]]) -> None:
        """Raise ValueError listing names the engine does not know and shapes that differ from
        :meth:`expected_weights`. (SGLang itself ignores unknown names and crashes on wrong shapes.)"""
        unknown = [n for n in names if n not in self._expected]
        bad = [(n, tuple(s), self._expected[n][0]) for n, s in zip(names, shapes)
               if n in self._expected and tuple(int(x) for x in s) != self._expected[n][0]]
        if unknown or bad:
            msg = []
            if unknown:
                msg.append(f"unknown weight names {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
            if bad:
                msg.append("wrong shapes " + ", ".join(f"{n}: got {g}, expected {e}" for n, g, e in bad[:5]))
            raise ValueError("weight update rejected: " + "; ".join(msg))

    def begin_weight_update(self) -> None:
        """Open a weight-update session (required by SGLang >= 0.5.23 around tensor/distributed updates)."""
        self._call("begin_weight_update")
        self._in_update = True
        self._updated_in_session = False

    def end_weight_update(self) -> None:
        """Close the session; bumps ``weight_version`` when anything was updated in it."""
        self._call("end_weight_update")
        self._in_update = False
        if self._updated_in_session:
            self.weight_version += 1
        self._updated_in_session = False

    def _in_session(self, fn):
        if self._in_update:
            return fn()
        self.begin_weight_update()
        try:
            out = fn()
        except EngineDiedError:
            raise
        except BaseException:
            try:
                self.end_weight_update()
            except (EngineCallError, EngineDiedError):
                pass
            raise
        self.end_weight_update()
        return out

    def update_weights_from_tensor(self, named_tensors: Sequence[Tuple[str, torch.Tensor]],
                                   validate: bool = True, flush_cache: bool = True) -> None:
        """Load full (unsharded) HF-named tensors into the engine; the KV/prefix cache is flushed after.

        Opens and closes a weight-update session itself unless one is open (:meth:`begin_weight_update`).
        Send large models in several calls inside one session.

        Args:
            named_tensors: ``[(hf_name, tensor)]`` as in :meth:`expected_weights`; CPU or CUDA tensors.
            validate: check names/shapes first (strongly recommended: a wrong shape kills the engine).
            flush_cache: flush the prefix cache after loading.
        Raises:
            ValueError: unknown names / wrong shapes (engine untouched). EngineDiedError: the engine died.
        """
        named = [(str(n), t) for n, t in named_tensors]
        for n, t in named:
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"update_weights_from_tensor: value of {n!r} is {type(t).__name__}, not a Tensor")
        if validate:
            self.validate_named_tensors([n for n, _ in named], [tuple(t.shape) for _, t in named])
        named = [(n, t.detach().contiguous()) for n, t in named]

        def run():
            self._call("update_weights_from_tensor", named, flush_cache)
            self._updated_in_session = True

        self._in_session(run)

    def update_weights_from_disk(self, path: str) -> None:
        """Reload all weights from a HF checkpoint directory (same architecture); bumps ``weight_version``."""
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise ValueError(f"update_weights_from_disk: {path!r} is not a directory")
        self._call("update_weights_from_disk", path)
        self.weight_version += 1

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str, backend: str = "nccl") -> None:
        """Join a process group used to receive broadcast weights (the trainer is rank 0).

        This blocks until every member joined; the trainer must create its side concurrently, e.g. with
        :meth:`init_weights_update_group_async` here and ``init_custom_process_group`` there. Engine ranks are
        ``rank_offset .. rank_offset + tp_size - 1``. Use backend "gloo" on CPU.
        """
        self.init_weights_update_group_async(master_address, master_port, rank_offset, world_size,
                                             group_name, backend).wait()

    def init_weights_update_group_async(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str = "nccl") -> PendingCall:
        """Non-blocking :meth:`init_weights_update_group`; ``.wait()`` on the handle."""
        if rank_offset < 1 or rank_offset + self.tp_size > world_size:
            raise ValueError(f"init_weights_update_group: ranks {rank_offset}..{rank_offset + self.tp_size - 1} "
                             f"do not fit world_size={world_size} (rank 0 is the trainer)")
        return self._call_async("init_weights_update_group", str(master_address), int(master_port),
                                int(rank_offset), int(world_size), str(group_name), str(backend))

    def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[Any],
                                        shapes: Sequence[Sequence[int]], group_name: str,
                                        validate: bool = True) -> None:
        """Receive tensors broadcast by rank 0 of ``group_name``, in ``names`` order; see the async variant."""
        self.update_weights_from_distributed_async(names, dtypes, shapes, group_name, validate).wait()

    def update_weights_from_distributed_async(self, names: Sequence[str], dtypes: Sequence[Any],
                                              shapes: Sequence[Sequence[int]], group_name: str,
                                              validate: bool = True) -> PendingCall:
        """Start receiving broadcast weights and return at once; the trainer then broadcasts each tensor
        (``dist.broadcast(t, src=0, group=pg)`` in ``names`` order) and calls ``handle.wait()``.

        Must be inside :meth:`begin_weight_update` / :meth:`end_weight_update`.

        Args:
            names / dtypes / shapes: one entry per tensor; dtypes as torch.dtype or "float32"-style strings.
        Raises:
            ValueError: lengths differ, unknown names, wrong shapes, or no open session.
        """
        names = [str(n) for n in names]
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError(f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}")
        if not self._in_update:
            raise ValueError("update_weights_from_distributed must run between begin_weight_update() and "
                             "end_weight_update()")
        shapes = [[int(x) for x in s] for s in shapes]
        if validate:
            self.validate_named_tensors(names, shapes)
        dts = [str(d).replace("torch.", "") for d in dtypes]
        self._updated_in_session = True
        return self._call_async("update_weights_from_distributed", names, dts, shapes, str(group_name))

    def destroy_weights_update_group(self, group_name: str) -> None:
        """Leave the weight-update process group ``group_name``."""
        self._call("destroy_weights_update_group", str(group_name))

    def get_weights_by_name(self, name: str, truncate_size: int = 1 << 30) -> torch.Tensor:
        """The engine's (TP rank 0) copy of a parameter by SGLang name (fused names like ``qkv_proj`` too),
        first ``truncate_size`` rows. Raises EngineCallError for unknown names."""
        out = self._call("get_weights_by_name", str(name), int(truncate_size))
        if out is None:
            raise EngineCallError(f"get_weights_by_name: the engine has no parameter {name!r}")
        return torch.as_tensor(out)

    def flush_cache(self) -> None:
        """Drop the prefix (radix) cache."""
        self._call("flush_cache")

    def release_memory_occupation(self) -> None:
        """Free weights and KV cache (colocated mode, before training); generation is invalid until resumed."""
        self._call("release_memory_occupation")

    def resume_memory_occupation(self) -> None:
        """Re-allocate what :meth:`release_memory_occupation` freed (weights keep their values)."""
        self._call("resume_memory_occupation")


# ====================================================================== child process side
def _check(result, what):
    """SGLang control calls return (success, message, ...) tuples or objects with .success."""
    if isinstance(result, tuple) and result and isinstance(result[0], bool):
        if not result[0]:
            raise RuntimeError(f"{what} failed: {result[1] if len(result) > 1 else ''}")
        return None
    if hasattr(result, "success") and result.success is False:
        raise RuntimeError(f"{what} failed: {getattr(result, 'message', '')}")
    return None


class _ChildServer:
    def __init__(self, engine):
        self.engine = engine

    def generate(self, input_ids, params):
        outs = self.engine.generate(input_ids=input_ids, sampling_params=params, return_logprob=True)
        if isinstance(outs, dict):
            outs = [outs]
        res = []
        for o in outs:
            meta = o["meta_info"]
            fr = meta.get("finish_reason") or {}
            lps = meta.get("output_token_logprobs") or []
            ids = o.get("output_ids")
            if ids is None:
                ids = [int(t[1]) for t in lps]
            res.append(dict(output_ids=[int(t) for t in ids], logprobs=[float(t[0]) for t in lps],
                            finish_type=fr.get("type") if isinstance(fr, dict) else str(fr),
                            finish_detail=fr))
        return res

    def begin_weight_update(self):
        return _check(self.engine.begin_weight_update(), "begin_weight_update")

    def end_weight_update(self):
        return _check(self.engine.end_weight_update(), "end_weight_update")

    def update_weights_from_tensor(self, named, flush_cache):
        return _check(self.engine.update_weights_from_tensor(named_tensors=named, flush_cache=flush_cache),
                      "update_weights_from_tensor")

    def update_weights_from_disk(self, path):
        return _check(self.engine.update_weights_from_disk(path), "update_weights_from_disk")

    def init_weights_update_group(self, addr, port, rank_offset, world_size, group_name, backend):
        return _check(self.engine.init_weights_update_group(master_address=addr, master_port=port,
                                                            rank_offset=rank_offset, world_size=world_size,
                                                            group_name=group_name, backend=backend),
                      "init_weights_update_group")

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name):
        return _check(self.engine.update_weights_from_distributed(names=names, dtypes=dtypes, shapes=shapes,
                                                                  group_name=group_name),
                      "update_weights_from_distributed")

    def destroy_weights_update_group(self, group_name):
        return _check(self.engine.destroy_weights_update_group(group_name), "destroy_weights_update_group")

    def get_weights_by_name(self, name, truncate_size):
        return self.engine.get_weights_by_name(name, truncate_size=truncate_size)

    def flush_cache(self):
        return _check(self.engine.flush_cache(), "flush_cache")

    def release_memory_occupation(self):
        return _check(self.engine.release_memory_occupation(), "release_memory_occupation")

    def resume_memory_occupation(self):
        return _check(self.engine.resume_memory_occupation(), "resume_memory_occupation")


def _watch_parent(parent_pid: int) -> None:
    # If the owner dies without shutting us down, take the whole engine process group with us.
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os.killpg(os.getpgid(0), signal.SIGKILL)


def _child_main(fd: int) -> None:
    conn = multiprocessing.connection.Connection(fd)
    cfg = conn.recv()
    # lets torch's pickler fetch shared-memory file descriptors of tensors from the parent's resource sharer
    multiprocessing.current_process().authkey = cfg["authkey"]
    import torch.multiprocessing  # noqa: F401  (registers tensor reductions for the connection's pickler)

    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    t0 = time.time()
    try:
        import sglang

        engine = sglang.Engine(**cfg["engine_kwargs"])
    except BaseException as e:  # report the start failure, then exit
        try:
            conn.send(("err", type(e).__name__, str(e), traceback.format_exc()))
        finally:
            os._exit(3)
    server = _ChildServer(engine)
    conn.send(("ok", {"pid": os.getpid(), "startup_seconds": time.time() - t0}))
    try:
        while True:
            try:
                method, args, kwargs = conn.recv()
            except (EOFError, OSError):
                break
            if method == "shutdown":
                conn.send(("ok", None))
                break
            try:
                result = getattr(server, method)(*args, **kwargs)
                reply = ("ok", result)
            except Exception as e:  # noqa: BLE001 - forwarded to the parent
                reply = ("err", type(e).__name__, str(e), traceback.format_exc())
            del args, kwargs
            conn.send(reply)
    finally:
        try:
            engine.shutdown()
        except Exception:
            pass
        os._exit(0)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="SGLang engine child process (started by RolloutEngine)")
    ap.add_argument("--fd", type=int, required=True)
    _child_main(ap.parse_args().fd)
