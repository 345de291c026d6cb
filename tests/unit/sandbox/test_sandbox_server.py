"""The local sandbox (rlhf/sandbox/): SandboxFusion's /run_code answers, and hostile code contained while the
server keeps serving.  One server for the module (a child process, as the trainer starts it), namespaced
isolation; the module skips, saying why, where namespaces cannot be made (not root / not Linux)."""
import base64
import json
import os
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from rlhf.sandbox import run_code, start_local_sandbox  # noqa: E402
from rlhf.sandbox.runners import parse_run_status, supported_languages  # noqa: E402

SECRET = "rlhf-sandbox-test-secret-7f3a"


@pytest.fixture(scope="module")
def url():
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        pytest.skip("the namespaced sandbox needs Linux and root (CAP_SYS_ADMIN)")
    os.environ["RLHF_SANDBOX_TEST_SECRET"] = SECRET  # the server inherits it; runs must not see it
    try:
        box = start_local_sandbox(isolation="namespaces", max_concurrency=8)
        try:
            u = box.start()
        except RuntimeError as e:
            pytest.skip(f"namespaces are not available here: {e}")
        yield u
        box.close()
        assert box.proc.returncode is not None
    finally:
        os.environ.pop("RLHF_SANDBOX_TEST_SECRET", None)


def _run(url, code, language="python", **kw):
    kw.setdefault("run_timeout", 5)
    return run_code(url, code, language=language, **kw)


def _still_serving(url):
    r = _run(url, "print(6 * 7)")
    assert r["status"] == "Success" and r["run_result"]["stdout"] == "42\n", r


# ----------------------------------------------------------------------------- the API


def test_python_success_has_sandbox_fusions_fields(url):
    r = _run(url, "import sys\nprint(input()[::-1]); print('err', file=sys.stderr)", stdin="abc\n")
    assert set(r) == {"status", "message", "compile_result", "run_result", "executor_pod_name", "files"}
    assert r["status"] == "Success" and r["message"] == "" and r["compile_result"] is None and r["files"] == {}
    rr = r["run_result"]
    assert set(rr) == {"status", "execution_time", "return_code", "stdout", "stderr"}
    assert (rr["status"], rr["return_code"], rr["stdout"], rr["stderr"]) == ("Finished", 0, "cba\n", "err\n")
    assert 0 < rr["execution_time"] < 5


def test_nonzero_exit_and_signal_are_failed_with_the_return_code(url):
    r = _run(url, "import sys; sys.exit(3)")
    assert (r["status"], r["run_result"]["status"], r["run_result"]["return_code"]) == ("Failed", "Finished", 3)
    r = _run(url, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert (r["status"], r["run_result"]["return_code"]) == ("Failed", -9)


def test_bash_files_and_fetch_files(url):
    files = {"data/in.txt": base64.b64encode(b"hello").decode()}
    r = _run(url, "cat data/in.txt; echo made > out.txt; ln -s /etc/passwd leak", "bash", files=files,
             fetch_files=["out.txt", "leak", "../../etc/passwd", "missing"])
    assert r["status"] == "Success" and r["run_result"]["stdout"] == "hello"
    assert r["files"] == {"out.txt": base64.b64encode(b"made\n").decode()}  # no symlink / path out of the folder


@pytest.mark.skipif("cpp" not in supported_languages(), reason="g++ is not installed")
def test_cpp_compiles_runs_and_reports_compile_errors(url):
    r = _run(url, "#include <cstdio>\nint main(){int a,b;scanf(\"%d %d\",&a,&b);printf(\"%d\\n\",a+b);}", "cpp",
             stdin="2 40")
    assert r["status"] == "Success" and r["compile_result"]["return_code"] == 0
    assert r["run_result"]["stdout"] == "42\n"
    r = _run(url, "int main(){", "cpp")
    assert r["status"] == "Failed" and r["run_result"] is None
    assert r["compile_result"]["status"] == "Finished" and r["compile_result"]["return_code"] != 0
    assert "error" in r["compile_result"]["stderr"]


def test_bad_requests(url):
    with pytest.raises(urllib.error.HTTPError) as ei:
        _run(url, "x", "klingon")
    assert ei.value.code == 422 and "klingon" in json.loads(ei.value.read())["detail"]
    r = _run(url, "class A {}", "java")  # a SandboxFusion language this sandbox does not run
    assert r["status"] == "SandboxError" and "not supported by the local sandbox" in r["message"]
    with urllib.request.urlopen(url.replace("/run_code", "/v1/ping")) as resp:
        assert resp.read() == b"pong"


def test_parse_run_status_is_sandbox_fusions():
    ok = {"status": "Finished", "return_code": 0, "stderr": ""}
    assert parse_run_status(None, ok) == ("Success", "")
    assert parse_run_status({**ok, "return_code": 1}, None) == ("Failed", "")
    assert parse_run_status(ok, {"status": "TimeLimitExceeded", "return_code": None}) == ("Failed", "")
    assert parse_run_status(None, {"status": "Error", "stderr": "boom"}) == ("SandboxError", "boom")


# ----------------------------------------------------------------------------- hostile code


def test_network_connections_fail(url):
    code = ("import socket\n"
            "for host in [('1.1.1.1', 80), ('127.0.0.1', %d)]:\n"
            "    try:\n"
            "        socket.create_connection(host, timeout=2); print('connected', host)\n"
            "    except OSError as e:\n"
            "        print('refused', type(e).__name__)\n" % int(url.split(":")[2].split("/")[0]))
    r = _run(url, code)
    assert r["status"] == "Success", r
    assert "connected" not in r["run_result"]["stdout"] and r["run_result"]["stdout"].count("refused") == 2
    _still_serving(url)


def test_writes_outside_the_run_folder_fail(url, tmp_path):
    os.chmod(tmp_path, 0o777)  # even a world-writable folder of the host is read-only in the sandbox
    targets = [str(tmp_path / "escape.txt"), "/tmp/rlhf-sandbox-escape.txt", str(Path(__file__).parent / "x.txt")]
    code = ("import os\nfor p in %r:\n    try:\n        open(p, 'w').write('x'); print('wrote', p)\n"
            "    except OSError as e:\n        print('denied', e.errno)\n"
            "open('mine.txt', 'w').write('ok'); print(open('mine.txt').read())\n" % targets)
    r = _run(url, code)
    assert r["status"] == "Success", r
    assert "wrote" not in r["run_result"]["stdout"] and r["run_result"]["stdout"].endswith("ok\n")
    assert not any(os.path.exists(p) for p in targets)
    _still_serving(url)


def test_the_servers_environment_is_not_visible(url):
    code = ("import os, glob\nprint(sorted(os.environ))\nhits = []\n"
            "for p in glob.glob('/proc/*/environ'):\n"
            "    try:\n        hits += [p] if %r in open(p).read() else []\n"
            "    except OSError:\n        pass\nprint('hits', hits, os.getuid(), len(glob.glob('/proc/[0-9]*')))\n"
            % SECRET)
    r = _run(url, code)
    out = r["run_result"]["stdout"]
    assert r["status"] == "Success" and SECRET not in out and "RLHF_SANDBOX_TEST_SECRET" not in out, r
    assert "hits []" in out and " 0 " not in out  # not root, sees its own processes only


def test_endless_loop_is_a_time_limit(url):
    t = time.monotonic()
    r = _run(url, "while True: pass", run_timeout=1)
    assert time.monotonic() - t < 10
    assert r["status"] == "Failed" and r["run_result"]["status"] == "TimeLimitExceeded"
    assert r["run_result"]["return_code"] is None and r["run_result"]["execution_time"] >= 1
    _still_serving(url)


def test_processes_left_behind_and_a_new_session_are_killed_on_timeout(url):
    r = _run(url, "(setsid sleep 1000 &) ; sleep 1000 & echo started; wait", "bash", run_timeout=1)
    assert r["run_result"]["status"] == "TimeLimitExceeded" and r["run_result"]["stdout"] == "started\n"
    time.sleep(0.5)
    left = [p for p in os.listdir("/proc") if p.isdigit() and _cmdline(p) == "sleep\x001000\x00"]
    assert left == [], left
    _still_serving(url)


def _cmdline(pid):
    try:
        return open(f"/proc/{pid}/cmdline").read()
    except OSError:
        return ""


def test_fork_bomb_is_contained(url):
    r = _run(url, "import os\nwhile True:\n    os.fork()", run_timeout=2)
    assert r["status"] == "Failed" and "Resource temporarily unavailable" in r["run_result"]["stderr"], r
    r = _run(url, ":(){ :|:& };:", "bash", run_timeout=2)
    assert r["run_result"]["status"] in ("Finished", "TimeLimitExceeded")
    _still_serving(url)


def test_memory_bomb_is_contained(url):
    r = _run(url, "a = []\nwhile True:\n    a.append(bytearray(10 ** 7))", memory_limit_mb=256)
    assert r["status"] == "Failed" and r["run_result"]["status"] == "Finished", r
    assert "MemoryError" in r["run_result"]["stderr"]
    _still_serving(url)


def test_huge_output_is_cut_at_one_mib(url):
    r = _run(url, "import sys\nfor _ in range(4096): sys.stdout.write('x' * 1024)")
    assert r["status"] == "Success" and len(r["run_result"]["stdout"]) == 1024 * 1024


def test_concurrent_runs(url):
    code = "import time, os\ntime.sleep(1)\nprint(int(input()) ** 2)"
    t = time.monotonic()
    with ThreadPoolExecutor(8) as ex:
        rs = list(ex.map(lambda i: _run(url, code, stdin=str(i)), range(8)))
    wall = time.monotonic() - t
    assert [r["run_result"]["stdout"] for r in rs] == [f"{i * i}\n" for i in range(8)]
    assert wall < 6, f"8 runs of 1 s took {wall:.1f} s: they did not overlap"
