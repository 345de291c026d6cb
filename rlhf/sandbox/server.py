"""The local sandbox's HTTP server (aiohttp), speaking SandboxFusion's API:

* ``POST /run_code``: :func:`rlhf.sandbox.runners.run_code` (422 with ``{"detail": ...}`` on a malformed body);
* ``GET /v1/ping``: ``pong``;
* ``GET /v1/info``: ``{"isolation": "namespaces" | "none", "fallback": why or null, "languages": [...]}``.

Start it with ``rlhf sandbox serve --host H --port P`` or ``python -m rlhf.sandbox.server``; the trainer starts
its own with :func:`rlhf.sandbox.start_local_sandbox`.  Every request runs in its own isolated jail
(:mod:`rlhf.sandbox.isolation`); many run at once (``--max-concurrency``), the rest wait.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import socket
import sys
from typing import Optional, Sequence

from aiohttp import web

from .isolation import ISOLATION_MODES, Isolation, Limits, SandboxUnavailable
from .runners import RequestError, run_code, supported_languages

__all__ = ["make_app", "serve", "main", "READY_LINE"]

logger = logging.getLogger(__name__)
#: printed (then the URL of /run_code) once the server accepts requests; start_local_sandbox waits for it
READY_LINE = "rlhf sandbox listening on"


def make_app(iso: Isolation) -> web.Application:
    """The aiohttp application serving ``iso``'s runs."""
    async def handle_run_code(request: web.Request) -> web.Response:
        try:
            body = await request.json(loads=json.loads)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return web.json_response({"detail": f"the body is not JSON: {e}"}, status=422)
        try:
            return web.json_response(await run_code(iso, body))
        except RequestError as e:
            return web.json_response({"detail": str(e)}, status=422)

    async def ping(_: web.Request) -> web.Response:
        return web.Response(text="pong")

    async def info(_: web.Request) -> web.Response:
        return web.json_response({"isolation": iso.mode, "fallback": iso.fallback,
                                  "languages": supported_languages()})

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.add_routes([web.post("/run_code", handle_run_code), web.get("/v1/ping", ping), web.get("/v1/info", info)])
    return app


async def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        await asyncio.sleep(1.0)
    logger.warning("the sandbox's parent process %d is gone; stopping", parent)
    raise web.GracefulExit()


def serve(host: str = "127.0.0.1", port: int = 8080, isolation: str = "auto", max_concurrency: Optional[int] = None,
          limits: Optional[Limits] = None, exit_with_parent: bool = False) -> None:
    """Serve until interrupted (or, with ``exit_with_parent``, until the parent process exits); prints
    ``READY_LINE http://HOST:PORT/run_code`` once listening (``port=0``: a free port).

    Raises:
        SandboxUnavailable: ``isolation="namespaces"`` cannot be set up here.
        OSError: the address is in use.
    """
    iso = Isolation(isolation, limits=limits, max_concurrency=max_concurrency)  # probes before the loop starts
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound = sock.getsockname()[1]
    app = make_app(iso)
    parent = os.getppid()

    async def on_startup(_):
        print(f"{READY_LINE} http://{host}:{bound}/run_code (isolation: {iso.mode})", flush=True)
        if exit_with_parent:
            app["parent_watch"] = asyncio.get_running_loop().create_task(_watch_parent(parent))

    app.on_startup.append(on_startup)
    try:
        web.run_app(app, sock=sock, print=None, handle_signals=True)
    finally:
        shutil.rmtree(iso.root, ignore_errors=True)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (0: a free one; default 8080)")
    p.add_argument("--isolation", choices=ISOLATION_MODES, default="auto",
                   help="namespaces (Linux, root), none (trusted code only), auto: namespaces else none with a "
                        "warning (default)")
    p.add_argument("--max-concurrency", type=int, default=None, help="runs at once (default 2 x CPUs, >= 4)")
    p.add_argument("--nproc", type=int, default=Limits.nproc, help="processes + threads per run")
    p.add_argument("--max-memory-mb", type=int, default=Limits.max_memory_mb,
                   help="cap on a request's memory_limit_MB (and the limit when it is -1)")
    p.add_argument("--exit-with-parent", action="store_true", help="stop when the parent process exits")


def serve_from_args(args: argparse.Namespace) -> int:
    limits = Limits(nproc=args.nproc, max_memory_mb=args.max_memory_mb)
    try:
        serve(args.host, args.port, args.isolation, args.max_concurrency, limits, args.exit_with_parent)
    except SandboxUnavailable as e:
        print(f"rlhf sandbox serve: {e}; use --isolation auto or none to run without it", file=sys.stderr)
        return 2
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlhf.sandbox.server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_args(p)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return serve_from_args(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
