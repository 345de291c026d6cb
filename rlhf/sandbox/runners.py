"""SandboxFusion's ``POST /run_code`` on :class:`rlhf.sandbox.isolation.Isolation`: request checking, the
language runners (python, bash, cpp when g++ exists) and the response, field for field as SandboxFusion's
``sandbox/server/sandbox_api.py`` (RunCodeRequest / RunCodeResponse / parse_run_status) and
``sandbox/runners/major.py`` (the commands) answer them.

Request: ``{code, language, compile_timeout=10, run_timeout=10, memory_limit_MB=-1, stdin=None,
files={path: base64 | None}, fetch_files=[path]}``.  Response: ``{status: Success | Failed | SandboxError,
message, compile_result, run_result, executor_pod_name, files}`` with each result ``{status: Finished | Error |
TimeLimitExceeded, execution_time, return_code, stdout, stderr}``.
"""
from __future__ import annotations

import base64
import os
import shutil
from typing import Any, Dict, List, Optional, Tuple

from .isolation import Isolation

__all__ = ["SANDBOX_FUSION_LANGUAGES", "RequestError", "run_code", "supported_languages", "parse_run_status"]

#: every language SandboxFusion's RunCodeRequest accepts (sandbox/runners/types.py); others are a 422
SANDBOX_FUSION_LANGUAGES = (
    "python", "cpp", "nodejs", "go", "go_test", "java", "php", "csharp", "bash", "typescript", "sql", "rust", "cuda",
    "lua", "R", "perl", "D_ut", "ruby", "scala", "julia", "pytest", "junit", "kotlin_script", "jest", "verilog",
    "python_gpu", "lean", "swift", "racket")
_SOURCE_NAME = {"python": "code.py", "bash": "code.sh", "cpp": "code.cpp"}


class RequestError(ValueError):
    """A malformed request (HTTP 422, like SandboxFusion's pydantic validation)."""


def supported_languages() -> List[str]:
    """Languages this sandbox runs here: python, bash, and cpp when ``g++`` is on PATH."""
    return ["python", "bash"] + (["cpp"] if shutil.which("g++") else [])


def _commands(lang: str, iso: Isolation, src: str, folder: str) -> Tuple[Optional[List[str]], List[str]]:
    """(compile command or None, run command), SandboxFusion's (major.py): ``python code.py``,
    ``/bin/bash code.sh``, ``g++ -std=c++17 code.cpp -o test -lpthread`` then ``./test``."""
    if lang == "python":
        return None, [iso.python, src]
    if lang == "bash":
        return None, ["/bin/bash", src]
    exe = os.path.join(folder, "test")
    return [shutil.which("g++") or "g++", "-std=c++17", src, "-o", exe, "-lpthread"], [exe]


def _check(req: Any) -> Dict[str, Any]:
    if not isinstance(req, dict):
        raise RequestError(f"the body must be a JSON object, got {type(req).__name__}")
    if not isinstance(req.get("code"), str):
        raise RequestError("field 'code' (a string) is required")
    if req.get("language") not in SANDBOX_FUSION_LANGUAGES:
        raise RequestError(f"language={req.get('language')!r} is not one of {list(SANDBOX_FUSION_LANGUAGES)}")
    out = {"code": req["code"], "language": req["language"], "stdin": req.get("stdin"),
           "files": req.get("files") or {}, "fetch_files": req.get("fetch_files") or []}
    for key, default in (("compile_timeout", 10.0), ("run_timeout", 10.0), ("memory_limit_MB", -1)):
        value = req.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RequestError(f"{key}={value!r} must be a number")
        out[key] = value
    if out["stdin"] is not None and not isinstance(out["stdin"], str):
        raise RequestError(f"stdin must be a string or null, got {type(out['stdin']).__name__}")
    if not isinstance(out["files"], dict) or not isinstance(out["fetch_files"], list):
        raise RequestError("files must be an object {path: base64 content} and fetch_files a list of paths")
    return out


def _inside(folder: str, name: str) -> str:
    """``folder/name`` resolved; ValueError when it lands outside ``folder`` (``..``, absolute, symlinks)."""
    path = os.path.realpath(os.path.join(folder, name))
    if os.path.commonpath([path, folder]) != folder or path == folder:
        raise ValueError(f"file path {name!r} is outside the run's folder")
    return path


def _restore_files(folder: str, files: Dict[str, Optional[str]], uid: Optional[int]) -> None:
    for name, content in files.items():
        if not isinstance(content, str) or "IGNORE_THIS_FILE" in name:  # SandboxFusion's restore_files
            continue
        path = _inside(folder, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(base64.b64decode(content))
    if uid is not None:
        for dirpath, dirs, names in os.walk(folder):
            for n in dirs + names:
                os.lchown(os.path.join(dirpath, n), uid, uid)


def _fetch_files(folder: str, names: List[str]) -> Dict[str, str]:
    out = {}
    for name in names:
        try:
            path = _inside(folder, name)  # a symlink the code made to a file of the server's is not followed
        except ValueError:
            continue
        if os.path.isfile(path):
            with open(path, "rb") as f:
                out[name] = base64.b64encode(f.read()).decode()
    return out


def parse_run_status(compile_result: Optional[dict], run_result: Optional[dict]) -> Tuple[str, str]:
    """SandboxFusion's parse_run_status: SandboxError (with that step's stderr) when a step is Error, else Failed
    when a step timed out or returned non-zero, else Success."""
    steps = [r for r in (compile_result, run_result) if r is not None]
    for r in steps:
        if r["status"] == "Error":
            return "SandboxError", r.get("stderr") or ""
    if any(r["status"] == "TimeLimitExceeded" for r in steps):
        return "Failed", ""
    if any(r.get("return_code") not in (None, 0) for r in steps):
        return "Failed", ""
    return "Success", ""


async def run_code(iso: Isolation, request: Any) -> Dict[str, Any]:
    """Answer one ``/run_code`` request (a dict parsed from JSON).

    Raises:
        RequestError: malformed request (the server answers HTTP 422 with the message).
    """
    req = _check(request)
    resp: Dict[str, Any] = {"status": "Success", "message": "", "compile_result": None, "run_result": None,
                            "executor_pod_name": None, "files": {}}
    lang = req["language"]
    if lang not in supported_languages():
        resp.update(status="SandboxError", message=f"language {lang!r} is not supported by the local sandbox "
                    f"(supported here: {supported_languages()}); use a SandboxFusion service for it")
        return resp
    uid = iso.take_uid()
    folder = iso.new_folder(uid)
    try:
        _restore_files(folder, req["files"], uid)
        src = os.path.join(folder, _SOURCE_NAME[lang])
        with open(src, "w", encoding="utf-8") as f:
            f.write(req["code"])
        if uid is not None:
            os.chown(src, uid, uid)
        compile_cmd, run_cmd = _commands(lang, iso, src, folder)
        mem = req["memory_limit_MB"]
        if compile_cmd is not None:
            # a compiler needs more than most programs; never less than 2 GiB (still capped by the server)
            cmem = -1 if mem <= 0 else max(mem, 2048)
            resp["compile_result"] = await iso.run(compile_cmd, timeout=req["compile_timeout"], memory_mb=cmem,
                                                   cwd=folder, uid=uid)
        c = resp["compile_result"]
        if c is None or (c["status"] == "Finished" and c["return_code"] == 0):
            resp["run_result"] = await iso.run(run_cmd, timeout=req["run_timeout"], memory_mb=mem,
                                               stdin=req["stdin"], cwd=folder, uid=uid)
        resp["files"] = _fetch_files(folder, req["fetch_files"])
        resp["status"], message = parse_run_status(resp["compile_result"], resp["run_result"])
        if resp["status"] == "SandboxError":
            resp["message"] = message
    except ValueError as e:
        resp.update(status="SandboxError", message=str(e))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        iso.give_uid(uid)
    return resp
