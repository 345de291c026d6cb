"""A local code sandbox speaking SandboxFusion's HTTP API (``POST /run_code``), for code rewards and tools.

    server.py     aiohttp server: /run_code, /v1/ping, /v1/info; ``rlhf sandbox serve``
    runners.py    the request / response of /run_code (SandboxFusion's fields and statuses), python, bash, cpp
    isolation.py  one isolated run: namespaces (mount, pid, net, ipc, uts), read-only file system but the run's
                  folder, own uid, rlimits, scrubbed environment; timeouts kill the whole run
    _jail.py      the process that sets the isolation up (standard library only)
    client.py     start_local_sandbox() (a server in a child process), local_sandbox_url(), run_code()

This package imports nothing else of rlhf (a leaf layer: rewards and tools call it).
"""
from .client import LOCAL, LocalSandbox, local_sandbox_url, run_code, start_local_sandbox

__all__ = ["LOCAL", "LocalSandbox", "local_sandbox_url", "run_code", "start_local_sandbox"]
