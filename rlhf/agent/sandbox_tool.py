"""verl's SandboxFusionTool (verl/tools/sandbox_fusion_tools.py): the model calls ``code_interpreter`` with
``code`` (and optionally ``timeout``, ``language``); the code runs in a SandboxFusion service and the tool message
is its stdout followed by its stderr.

verl's config keys, as written (verl's examples/sglang_multiturn/config/tool_config/sandbox_fusion_tool_config.yaml)::

    config:
      sandbox_fusion_url: local     # "local", "" or absent: this process's local sandbox (rlhf.sandbox), started
                                    # when the tool is built; a URL: that SandboxFusion service's /run_code
      num_workers: 10               # runs of this tool at once (verl: the Ray execution pool's concurrency)
      enable_global_rate_limit: true
      rate_limit: 10                # runs of all sandbox tools of the process at once (verl: its rate-limiter actor)
      default_timeout: 30           # run_timeout (s) of a call; a call's own ``timeout`` may only lower it
      default_language: python
      memory_limit_mb: 1024

Answers, as verl's ``execute_code``: a run that finished (any return code) -> ``stdout + stderr``; a run that did
not (time limit, runtime error status) -> ``"no stdout here"``.  Differences from verl, each safer: an unset URL
starts the local sandbox instead of raising; a call's ``timeout`` is capped at ``default_timeout`` (verl takes any
value the model writes); a sandbox that cannot be reached raises (the agent loop turns it into the model's
"Error when executing tool" message and ``tool_calls/exceptions``) where verl answers an empty message, and so
does a SandboxError answer (e.g. a language the local sandbox does not run), where verl answers "no stdout here".
"""
from __future__ import annotations

import asyncio
import threading
import uuid
from typing import Any, Optional

from rlhf.agent.tools import BaseTool, ToolResponse

__all__ = ["SandboxFusionTool", "NO_STDOUT"]

#: verl's answer for a run that did not finish
NO_STDOUT = "no stdout here"
_GLOBAL_LIMITS: dict[int, threading.BoundedSemaphore] = {}
_GLOBAL_LOCK = threading.Lock()


def _global_limit(rate_limit: int) -> threading.BoundedSemaphore:
    """The process-wide semaphore of ``rate_limit`` runs (verl's named "rate-limiter" actor, shared by tools)."""
    with _GLOBAL_LOCK:
        return _GLOBAL_LIMITS.setdefault(rate_limit, threading.BoundedSemaphore(rate_limit))


class SandboxFusionTool(BaseTool):
    """verl's SandboxFusionTool over a SandboxFusion ``/run_code`` (module docstring for the config keys).

    Raises (on construction):
        ValueError: a config value of the wrong type or range (named, as :meth:`config_problems` reports it).
        RuntimeError: ``sandbox_fusion_url`` is local and the local sandbox did not start.
    """

    _INT_KEYS = {"num_workers": 10, "rate_limit": 10, "memory_limit_mb": 1024}

    def __init__(self, config: dict, tool_schema: dict):
        super().__init__(config, tool_schema)
        problems = self.config_problems(self.config)
        if problems:
            raise ValueError("; ".join(problems))
        c = self.config
        self.num_workers, self.rate_limit = int(c.get("num_workers", 10)), int(c.get("rate_limit", 10))
        self.memory_limit_mb = int(c.get("memory_limit_mb", 1024))
        self.default_timeout = float(c.get("default_timeout", 30))
        self.default_language = str(c.get("default_language", "python"))
        self.enable_global_rate_limit = bool(c.get("enable_global_rate_limit", True))
        self._workers = threading.BoundedSemaphore(self.num_workers)  # threads: each step's rollout has its own loop
        self._rate = _global_limit(self.rate_limit) if self.enable_global_rate_limit else None
        self._instances: dict[str, dict] = {}
        url = c.get("sandbox_fusion_url") or ""
        if url in ("", "local"):
            from rlhf.sandbox import local_sandbox_url

            url = local_sandbox_url()  # started now, not in the first call's tool timeout
        self.sandbox_fusion_url = url

    @classmethod
    def config_problems(cls, config: dict) -> list[str]:
        """Bad values of the tool's ``config:`` (checked at ``--cfg``), each naming the key and the fix."""
        out = []
        for key in ("num_workers", "rate_limit", "memory_limit_mb"):
            v = config.get(key, cls._INT_KEYS[key])
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                out.append(f"SandboxFusionTool config {key}={v!r} must be an integer >= 1")
        v = config.get("default_timeout", 30)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            out.append(f"SandboxFusionTool config default_timeout={v!r} must be a number of seconds > 0")
        url = config.get("sandbox_fusion_url")
        if url not in (None, "", "local") and not (isinstance(url, str) and url.startswith(("http://", "https://"))):
            out.append(f"SandboxFusionTool config sandbox_fusion_url={url!r} must be an http(s) URL of a "
                       f"SandboxFusion /run_code, or 'local' (a local sandbox started by the trainer)")
        return out

    async def create(self, instance_id: Optional[str] = None, ground_truth: Optional[str] = None,
                     **kwargs) -> tuple[str, ToolResponse]:
        instance_id = instance_id or uuid.uuid4().hex
        self._instances[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": []}
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        """Run ``parameters["code"]``; returns (verl's answer text, 0.0, {"run_status": ...}).

        Raises:
            RuntimeError: the sandbox could not be reached or refused the request (e.g. an unknown language).
        """
        code = parameters.get("code", "")
        code = code if isinstance(code, str) else str(code)
        timeout = parameters.get("timeout", self.default_timeout)
        try:
            timeout = min(float(timeout), self.default_timeout)
        except (TypeError, ValueError):
            timeout = self.default_timeout
        timeout = timeout if timeout > 0 else self.default_timeout
        language = parameters.get("language", self.default_language)
        language = language if isinstance(language, str) else self.default_language
        return await asyncio.to_thread(self._run, code, timeout, language)

    def _run(self, code: str, timeout: float, language: str) -> tuple[ToolResponse, float, dict]:
        from rlhf.rewards.sandbox_code import run_single_case  # verl's _process_single_case

        with self._workers:
            if self._rate is not None:
                with self._rate:
                    _, meta = run_single_case(self.sandbox_fusion_url, code, timeout, self.memory_limit_mb, language)
            else:
                _, meta = run_single_case(self.sandbox_fusion_url, code, timeout, self.memory_limit_mb, language)
        if meta.get("api_request_error"):
            raise RuntimeError(f"the sandbox at {self.sandbox_fusion_url} did not run the code: "
                               f"{meta['api_request_error']}")
        if meta.get("api_status") == "SandboxError":  # the sandbox failed, not the code (verl: "no stdout here")
            raise RuntimeError(f"the sandbox at {self.sandbox_fusion_url} could not run the code: "
                               f"{(meta.get('api_response') or {}).get('message')}")
        status = meta.get("run_status")
        if status == "Finished":
            text = (meta.get("stdout") or "") + (meta.get("stderr") or "")
        else:
            text = NO_STDOUT
        return ToolResponse(text=text), 0.0, {"run_status": status}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        self._instances.pop(instance_id, None)
