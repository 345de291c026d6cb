"""verl's MCP tools (verl/tools/mcp_base_tool.py, mcp_search_tool.py; verl/tools/utils/tool_registry.py) over
local MCP servers, with the MCP Python SDK (``mcp``; ``pip install -e '.[agent]'``).

verl's MCP tool config, as written (examples/sglang_multiturn/config/tool_config/mcp_tool_config.yaml)::

    tools:
      - class_name: verl.tools.mcp_search_tool.MCPSearchTool    # or verl.tools.mcp_base_tool.MCPBaseTool
        config: {rate_limit: 120, timeout: 120, type: mcp}
        mcp:
          mcp_servers_config_path: ./mcp_server.json
          tool_selected_list: [tavily_search_tool]              # optional: the server tools to offer

and the servers file, ``{"mcpServers": {NAME: {"command": ..., "args": [...], "env": {...}, "cwd": ...}}}``: each
server is started as a child process speaking MCP over stdio (the SDK's ``stdio_client``) when the tools are built,
kept open for the run, and its tools (``list_tools``, filtered by ``tool_selected_list``) become tools of the agent
loop with the server's input schema as the function's parameters (verl's mcp2openai).  A call's answer is the
text parts of the result joined by spaces (verl's ``_parse_tool_result``); a failed call is the model's message
(verl's "Tool call failed: ..." text).  Servers given by ``url`` (verl's SSE servers, e.g. Tavily's, with
``auth_token``) are refused at ``--cfg``: the trainer starts its own tool servers and reaches no network service.
"""
from __future__ import annotations

import asyncio
import json
import os
import threading
import uuid
from pathlib import Path
from typing import Any, Optional

from rlhf.agent.tools import BaseTool, ToolResponse

__all__ = ["MCPTool", "mcp_tools", "mcp_config_problems"]


def _servers(path: str) -> dict:
    """``mcpServers`` of the servers file.  Raises ValueError naming the file and the problem."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"mcp.mcp_servers_config_path={path!r} is not a file (relative paths are read from "
                         f"{Path.cwd()})")
    try:
        servers = json.loads(p.read_text()).get("mcpServers")
    except (json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"{path!r} is not a JSON object with 'mcpServers' ({e})") from e
    if not isinstance(servers, dict) or not servers:
        raise ValueError(f"{path!r} has no 'mcpServers' {{name: {{command, args}}}}")
    for name, s in servers.items():
        if not isinstance(s, dict) or not isinstance(s.get("command"), str):
            why = ("a 'url' server (SSE / HTTP, e.g. Tavily's) is not connected to: the trainer starts its own MCP "
                   "servers over stdio and reaches no network service" if isinstance(s, dict) and "url" in s
                   else "it needs a 'command' (and 'args') that starts the server over stdio")
            raise ValueError(f"{path!r}: MCP server {name!r}: {why}")
    return servers


def mcp_config_problems(item: dict) -> list[str]:
    """Problems of one MCP entry of a tool config file (checked at ``--cfg``; the servers are not started)."""
    try:
        import mcp  # noqa: F401
    except ImportError:
        return ["MCP tools need the MCP Python SDK: pip install -e '.[agent]'"]
    path = (item.get("mcp") or {}).get("mcp_servers_config_path")
    if not path:
        return ["an MCP tool needs mcp.mcp_servers_config_path (verl's layout)"]
    try:
        _servers(str(path))
    except ValueError as e:
        return [str(e)]
    return []


class _ServerPool:
    """MCP client sessions kept open in one background event loop (the agent loop runs a new loop each step)."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="mcp-clients", daemon=True).start()
        self.sessions: dict[str, Any] = {}
        self._stop = None

    def run(self, coro, timeout: Optional[float] = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _hold(self, name: str, server: dict, ready: asyncio.Future) -> None:
        from mcp import ClientSession, StdioServerParameters
        from mcp.client.stdio import stdio_client

        params = StdioServerParameters(command=server["command"], args=[str(a) for a in server.get("args", [])],
                                       env={**os.environ, **server["env"]} if server.get("env") else None,
                                       cwd=server.get("cwd"))
        try:
            async with stdio_client(params) as (r, w), ClientSession(r, w) as session:
                await session.initialize()
                self.sessions[name] = session
                ready.set_result(None)
                await asyncio.Event().wait()  # open until the process exits
        except BaseException as e:  # noqa: BLE001 - reported to the builder
            if not ready.done():
                ready.set_exception(RuntimeError(f"MCP server {name!r} ({server['command']}) did not start: {e}"))
            raise

    def start(self, servers: dict, timeout: float) -> None:
        async def go():
            futs = []
            for name, server in servers.items():
                if name not in self.sessions:
                    fut = self.loop.create_future()
                    self.loop.create_task(self._hold(name, server, fut))
                    futs.append(fut)
            await asyncio.gather(*futs)
        self.run(asyncio.wait_for(go(), timeout))


_POOL: Optional[_ServerPool] = None
_POOL_LOCK = threading.Lock()


def _pool() -> _ServerPool:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = _ServerPool()
        return _POOL


class MCPTool(BaseTool):
    """One tool of an MCP server (verl's MCPBaseTool): ``config`` as verl's (``timeout``), ``tool_schema`` from the
    server; built by :func:`mcp_tools`."""

    def __init__(self, config: dict, tool_schema: dict, server: str = ""):
        super().__init__(config, tool_schema)
        self.server, self.timeout = server, float(self.config.get("timeout", 30))
        self._instances: dict[str, dict] = {}

    async def create(self, instance_id: Optional[str] = None, **kwargs) -> tuple[str, ToolResponse]:
        instance_id = instance_id or uuid.uuid4().hex
        self._instances[instance_id] = {"response": "", "reward": []}
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        """verl's execute: the result's text parts joined by " "; a failed call (an error result, a server that
        is gone, a timeout of ``config.timeout``) is the text verl gives it."""
        pool = _pool()
        session = pool.sessions.get(self.server)
        try:
            if session is None:
                raise ConnectionError(f"MCP server {self.server!r} is not running")
            fut = asyncio.run_coroutine_threadsafe(session.call_tool(self.name, parameters), pool.loop)
            result = await asyncio.wait_for(asyncio.wrap_future(fut), self.timeout)
            text = " ".join(p.text for p in result.content if getattr(p, "type", None) == "text")
            if getattr(result, "is_error", False) or getattr(result, "isError", False):
                text, error = f"\n Tool call failed: {text}", text
            else:
                error = None
        except (ConnectionError, asyncio.TimeoutError) as e:
            text, error = f"\n Connection failed: {e or 'timed out'}", str(e)
        except Exception as e:  # noqa: BLE001 - verl: the failure is the model's message
            text, error = f"\n An unexpected error occurred: {e}", str(e)
        if instance_id in self._instances:
            self._instances[instance_id]["reward"].append(text.strip())
        return ToolResponse(text=text), 0.0, {"api_request_error": error}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        self._instances.pop(instance_id, None)


def mcp_tools(item: dict, start_timeout_s: float = 120.0) -> dict[str, MCPTool]:
    """``{function name: tool}`` of one MCP entry of a tool config: its servers started (stdio) and their tools
    listed, kept to ``mcp.tool_selected_list`` when given.

    Raises:
        ValueError: a bad servers file, a selected tool no server offers, or a name offered twice.
        RuntimeError: a server did not start within ``start_timeout_s``.
    """
    mcp = item.get("mcp") or {}
    servers = _servers(str(mcp.get("mcp_servers_config_path")))
    selected = mcp.get("tool_selected_list") or None
    pool = _pool()
    pool.start(servers, start_timeout_s)
    out: dict[str, MCPTool] = {}
    for name in servers:
        listed = pool.run(pool.sessions[name].list_tools(), start_timeout_s)
        for t in listed.tools:
            if selected and t.name not in selected:
                continue
            if t.name in out:
                raise ValueError(f"MCP tool {t.name!r} is offered by two servers ({out[t.name].server}, {name})")
            params = getattr(t, "input_schema", None) or getattr(t, "inputSchema", None) or {"type": "object"}
            schema = {"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                       "parameters": params}}
            out[t.name] = MCPTool(dict(item.get("config") or {}), schema, server=name)
    missing = sorted(set(selected or ()) - set(out))
    if missing:
        raise ValueError(f"mcp.tool_selected_list names tools no server offers: {missing} (offered: {sorted(out)})")
    return out
