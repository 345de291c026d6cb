"""verl's code reward through a SandboxFusion service (``verl/utils/reward_score/sandbox_fusion/``, read against
verl's source; scores checked equal to verl's own function in tests/unit/rewards/test_sandbox_code_reward.py):
the program in the response's last python code block is run once per test case, stdin in, stdout compared
(trailing newlines stripped) with the expected output; the score is the fraction of cases passed.

``compute_score(url, semaphore, memory_limit_mb, completion, test_cases, continuous, timeout)`` is verl's
``sandbox_fusion.compute_score`` -> ``(score, metadata)``; the per-case results are verl's: True, False, -1 (API
or sandbox error), -2 (runtime error), -3 (time limit), -4 (compile error, and every later case).
``code_reward_overrides(...)`` gives the reward fns of verl's code data sources (codecontests, apps, codeforces,
taco: ``continuous=True``, the first 10 cases), as verl's ``default_compute_score`` with ``sandbox_fusion_url``.
``url="local"``: this process's local sandbox (rlhf.sandbox), started on first use.
"""
from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Tuple

__all__ = ["compute_score", "check_correctness", "run_single_case", "code_reward_overrides", "VERL_SANDBOX_DATA_SOURCES"]

logger = logging.getLogger(__name__)

#: verl's default_compute_score sends these to the sandbox when sandbox_fusion_url is set
VERL_SANDBOX_DATA_SOURCES = ("codecontests", "apps", "codeforces", "taco")

# verl's wrapper for call-based cases (fn_name): the user's code, then its function called on one JSON value per
# stdin line, the result printed (JSON for dict / list / tuple / None / bool)
_IMPORTS = ["string", "re", "datetime", "collections", "heapq", "bisect", "copy", "math", "random", "statistics",
            "itertools", "functools", "operator", "io", "sys", "json"]
_STAR = _IMPORTS[:14] + ["sys", "json", "builtins", "typing"]
_FN_WRAPPER = """
import traceback
{star}
{plain}

# === User's Original Code START ===
{generation}
# === User's Original Code END ===

_SANDBOX_FN_NAME = "{fn_name}"

def _execute_user_function():
    _raw_input_str = sys.stdin.read()
    _args = []
    if _raw_input_str.strip():
        try:
            _args = [json.loads(line) for line in _raw_input_str.split('\\n')]
        except json.JSONDecodeError as _je:
            sys.stderr.write(f"WrapperError: Invalid JSON input for '{{_SANDBOX_FN_NAME}}': {{_je}}\\nInput was: "
                              f"{{_raw_input_str[:200]}}\\n")
            return None, True
    try:
        _target_callable = None
        if _SANDBOX_FN_NAME in globals():
            _target_callable = globals()[_SANDBOX_FN_NAME]
        elif 'Solution' in globals():
            _Solution_class = globals()['Solution']
            _solution_instance = _Solution_class()
            _target_callable = getattr(_solution_instance, _SANDBOX_FN_NAME)
        if not _target_callable:
            sys.stderr.write(f"WrapperError: Function or method '{{_SANDBOX_FN_NAME}}' not found.\\n")
            return None, True
        _fn_result = _target_callable(*_args)
        return _fn_result, False
    except Exception:
        sys.stderr.write(f"Error during setup or execution of '{{_SANDBOX_FN_NAME}}':\\n{{traceback.format_exc()}}\\n")
        return None, True

if __name__ == '__main__':
    _result, _error_occurred = _execute_user_function()
    if not _error_occurred:
        if isinstance(_result, (dict, list, tuple)) or _result is None or isinstance(_result, bool):
            print(json.dumps(_result))
        elif isinstance(_result, (int, float, str)):
            print(str(_result))
        else:
            print(str(_result))
"""


def _wrap(generation: str, fn_name: str) -> str:
    return _FN_WRAPPER.format(star="\n".join(f"from {m} import *" for m in _STAR),
                              plain="\n".join(f"import {m}" for m in _IMPORTS), generation=generation,
                              fn_name=fn_name)


def _call_api(url: str, code: str, stdin: Optional[str], timeout: float, memory_limit_mb: int,
              language: str) -> Tuple[Optional[dict], Optional[str]]:
    """verl's call_sandbox_api: (response, None) or (None, error message); a 504 is retried twice."""
    import time
    import urllib.error

    from rlhf.sandbox import run_code

    last = None
    for attempt in range(3):
        try:
            return run_code(url, code, language=language, stdin=stdin, run_timeout=timeout, compile_timeout=timeout,
                            memory_limit_mb=memory_limit_mb, http_timeout=2 * timeout + 10), None
        except urllib.error.HTTPError as e:
            last = f"API Call Failed: API Request Error: {e}"
            if e.code != 504:
                break
            time.sleep(attempt + 1)
        except Exception as e:  # noqa: BLE001 - verl turns every request failure into a -1 case
            last = f"API Call Failed: API Request Error: {e}"
            break
    return None, last


def _classify(resp: dict, expected: Any) -> Tuple[Any, str]:
    """verl's _process_single_case decision: (result, metadata status) of one answered case."""
    api_status, compile_result, run_result = resp.get("status"), resp.get("compile_result"), resp.get("run_result")
    run_status = run_result.get("status") if run_result else None
    if api_status == "SandboxError":
        return -1, "sandbox_error"
    if api_status == "Failed":
        cs = compile_result.get("status") if compile_result else None
        if compile_result and (cs in ("Error", "TimeLimitExceeded")
                               or (cs == "Finished" and compile_result.get("return_code") != 0)):
            return -4, "compile_timeout" if cs == "TimeLimitExceeded" else "compile_error"
        if run_result:
            if run_status == "TimeLimitExceeded":
                return -3, "timeout"
            if run_status == "Error" or (run_status == "Finished" and run_result.get("return_code") != 0):
                return -2, "runtime_error"
            return -1, "unknown_failure"
        return -1, "unknown_failure_state"
    if api_status == "Success":
        if run_result and run_status == "Finished":
            out = run_result.get("stdout")
            out = "" if out is None else out
            if expected is None or str(out).rstrip("\n") == str(expected).rstrip("\n"):
                return True, "success"
            return False, "wrong_answer"
        return -1, "unexpected_success_state"
    return -1, f"unknown_api_status_{api_status}"


def _one_case(i: int, stdin_data: Any, expected: Any, url: str, generation: str, timeout: float,
              memory_limit_mb: int, language: str, semaphore: Optional[Any], fn_name: Optional[str]
              ) -> Tuple[Any, dict]:
    code = _wrap(generation, fn_name) if fn_name and language == "python" else generation
    stdin = None if stdin_data is None else str(stdin_data)
    if semaphore is not None:
        with semaphore:
            resp, err = _call_api(url, code, stdin, timeout, memory_limit_mb, language)
    else:
        resp, err = _call_api(url, code, stdin, timeout, memory_limit_mb, language)
    meta = {"case_index": i, "input": stdin, "expected_output": str(expected) if expected else None,
            "api_request_error": err, "api_response": resp, "status": "api_error" if err else "unknown_api_state"}
    if err or not resp:
        return -1, meta
    rr, cr = resp.get("run_result") or {}, resp.get("compile_result") or {}
    meta.update(api_status=resp.get("status"), compile_status=cr.get("status"), run_status=rr.get("status"),
                stdout=rr.get("stdout"), stderr=rr.get("stderr"), exit_code=rr.get("return_code"),
                duration=rr.get("execution_time"), compile_duration=cr.get("execution_time"),
                compile_stderr=cr.get("stderr"))
    result, meta["status"] = _classify(resp, expected)
    return result, meta


def run_single_case(url: str, code: str, timeout: float, memory_limit_mb: int = 1024,
                    language: str = "python") -> Tuple[Any, dict]:
    """verl's ``_process_single_case(0, None, None, url, code, timeout, memory_limit_mb, language)`` (how verl's
    SandboxFusionTool runs a call): (result, metadata with ``run_status``, ``stdout``, ``stderr``,
    ``api_request_error``).  Never raises for a failed request: it is in ``api_request_error``."""
    return _one_case(0, None, None, url, code, timeout, memory_limit_mb, language, None, None)


def check_correctness(url: str, in_outs: Optional[dict], generation: str, timeout: float = 10,
                      memory_limit_mb: int = 1024, language: str = "python",
                      concurrent_semaphore: Optional[Any] = None) -> Tuple[List[Any], List[dict]]:
    """verl's check_correctness: every case of ``in_outs`` ({"inputs", "outputs", optional "fn_name",
    "assert_case"}) run at once; per-case results (True / False / -1 / -2 / -3 / -4) and metadata, in order.
    After the first compile error (-4) every later case is -4 too."""
    if not in_outs or "inputs" not in in_outs or "outputs" not in in_outs:
        return [-1], [{"error": "Invalid input/output data"}]
    inputs, outputs = in_outs["inputs"], in_outs["outputs"]
    n = len(inputs)
    asserts = in_outs.get("assert_case", [""] * n)
    if n == 0:
        return [], []
    if len(outputs) != n or len(asserts) != n:
        return [-1] * n, [{"error": "Input/output count mismatch", "case_index": i} for i in range(n)]
    with ThreadPoolExecutor(max_workers=min(32, n)) as ex:
        futures = [ex.submit(_one_case, i, inputs[i], outputs[i], url, generation + "\n\n" + asserts[i], timeout,
                             memory_limit_mb, language, concurrent_semaphore, in_outs.get("fn_name"))
                   for i in range(n)]
        done = []
        for i, f in enumerate(futures):
            try:
                done.append(f.result())
            except Exception as e:  # noqa: BLE001 - verl's "internal_error" case
                done.append((-1, {"case_index": i, "status": "internal_error",
                                  "api_request_error": f"Internal execution error: {e}"}))
    results, metas = [r for r, _ in done], [m for _, m in done]
    first = next((i for i, r in enumerate(results) if r == -4), -1)
    if first != -1:
        for i in range(first + 1, n):
            if results[i] != -4:
                results[i] = -4
                metas[i]["status"] = "compile_error_skipped"
    return results, metas


def _solution(completion: str) -> Optional[str]:
    """The code of verl's compute_score: the last ```python block, else the first ``` block (a one-word language
    line dropped); None without a code block."""
    if "```python" in completion:
        return completion.split("```python")[-1].split("```")[0]
    if "```" in completion:
        parts = completion.split("```")
        solution = parts[1] if len(parts) >= 2 else completion
        if "\n" in solution:
            first, rest = solution.split("\n", 1)
            if first.strip().isalpha():
                solution = rest
        return solution
    return None


def compute_score(sandbox_fusion_url: str, concurrent_semaphore: Optional[Any], memory_limit_mb: int,
                  completion: str, test_cases: Any, continuous: bool = False, timeout: float = 10
                  ) -> Tuple[float, List[dict]]:
    """verl's sandbox_fusion.compute_score: (fraction of test cases passed, per-case metadata); with
    ``continuous`` only the first 10 cases count.  0.0 without a code block or with unreadable test cases."""
    solution = _solution(completion)
    if solution is None:
        return 0.0, [{"error": "Invalid completion (missing code block)"}]
    if not isinstance(test_cases, dict):
        try:
            test_cases = json.loads(test_cases)
        except (json.JSONDecodeError, TypeError):
            return 0.0, [{"error": "Invalid test_cases JSON format"}]
    if test_cases is not None and isinstance(test_cases.get("assert_case"), list):
        test_cases.setdefault("inputs", ["" for _ in test_cases["assert_case"]])
        test_cases.setdefault("outputs", [None for _ in test_cases["assert_case"]])
    elif not test_cases or "inputs" not in test_cases or "outputs" not in test_cases:
        return 0.0, [{"error": "Invalid test_cases structure (missing inputs/outputs)"}]
    results, metadata = check_correctness(sandbox_fusion_url, test_cases, solution, timeout=timeout,
                                          concurrent_semaphore=concurrent_semaphore, memory_limit_mb=memory_limit_mb)
    if not results:
        return 0.0, metadata
    counted = results[:10] if continuous else results
    return float(sum(1 for r in counted if r is True) / len(counted)), metadata


def code_reward_overrides(url: Optional[str], max_concurrent: int = 64,
                          memory_limit_mb: int = 1024) -> Dict[str, Callable[..., float]]:
    """data_source -> reward fn of verl's code data sources scored in the sandbox at ``url`` (``"local"``: a
    local sandbox of this process, started on first use); {} when ``url`` is None.  Each fn returns verl's
    ``default_compute_score`` value: ``float(compute_score(..., continuous=True)[0])``."""
    if not url:
        return {}
    semaphore = threading.Semaphore(max_concurrent)

    def code_reward(solution_str: str, ground_truth: Any) -> float:
        from rlhf.sandbox import LOCAL, local_sandbox_url

        target = local_sandbox_url() if url == LOCAL else url
        return float(compute_score(target, semaphore, memory_limit_mb, solution_str, ground_truth,
                                   continuous=True)[0])

    code_reward.__qualname__ = f"code_reward[sandbox_fusion.url={url}]"
    return {ds: code_reward for ds in VERL_SANDBOX_DATA_SOURCES}
