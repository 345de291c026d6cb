"""verl's MCP tool config (rlhf/agent/mcp_tool.py): the servers file starts a local MCP server over stdio
(tests/support/mcp_calc_server.py), its tools become agent-loop tools with the server's schemas, and a call's
answer is the server's text; URL servers and bad files are refused at --cfg."""
from __future__ import annotations

import json
import sys

import pytest

from rlhf.agent.config import MultiTurnSettings, config_problems, load_tool_specs
from rlhf.agent.loop import AgentLoop
from rlhf.agent.mcp_tool import MCPTool
from rlhf.agent.tools import build_tools
from rlhf.rollout.sampling import SamplingConfig
from tests.support.agent_fakes import ScriptedFleet, tool_call
from tests.support.paths import REPO

pytest.importorskip("mcp")

#: verl's examples/sglang_multiturn/config/tool_config/mcp_tool_config.yaml, but the servers file and the list
VERL_MCP_CONFIG = """\
tools:
  - class_name: verl.tools.mcp_search_tool.MCPSearchTool
    config:
      rate_limit: 120
      timeout: 120
      type: mcp
    mcp:
      mcp_servers_config_path: {servers}
      # optional
      tool_selected_list: 
        - add
        - fail
"""


def _config(tmp_path, servers: dict) -> str:
    (tmp_path / "mcp_server.json").write_text(json.dumps({"mcpServers": servers}))
    path = tmp_path / "mcp_tool_config.yaml"
    path.write_text(VERL_MCP_CONFIG.format(servers=tmp_path / "mcp_server.json"))
    return str(path)


@pytest.fixture(scope="module")
def tools(tmp_path_factory):
    path = _config(tmp_path_factory.mktemp("mcp"), {"calc": {
        "command": sys.executable, "args": [str(REPO / "tests" / "support" / "mcp_calc_server.py")]}})
    assert config_problems(MultiTurnSettings(enable=True, tool_config_path=path)) == []
    return build_tools(load_tool_specs(path))


def test_servers_tools_with_their_schemas(tools):
    assert sorted(tools) == ["add", "fail"] and all(isinstance(t, MCPTool) for t in tools.values())
    params = tools["add"].tool_schema["function"]["parameters"]
    assert params["required"] == ["a", "b"] and params["properties"]["a"]["type"] == "integer"
    assert tools["add"].tool_schema["function"]["description"] == "Add two integers."


def test_calls_in_the_agent_loop(tools, tok):
    calls = [tool_call("add", '{"a": 2, "b": 40}'), tool_call("fail", '{"reason": "no"}')]
    fleet = ScriptedFleet(tok, lambda turn, p: calls[turn] if turn < 2 else "done")
    agent = AgentLoop(MultiTurnSettings(enable=True, max_tool_response_length=500), tok, 2000, tools=tools)
    [s], m = agent.run(fleet.generate, [{"raw_prompt": "Add.", "extra_info": {}}], SamplingConfig(max_new_tokens=1))
    spans = s.extra["model_spans"]
    texts = [tok.decode(s.response_ids[spans[k][1]:spans[k + 1][0]]) for k in range(2)]
    assert texts[0] == "<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    assert texts[1].startswith("<|im_start|>tool\n\n Tool call failed: ") and "refused: no" in texts[1]
    assert m["tool_calls/mean"] == 2


@pytest.mark.parametrize("servers, message", [
    ({"tavily": {"url": "https://example.invalid/sse", "auth_token": "t"}}, "a 'url' server (SSE / HTTP"),
    ({"calc": {"args": ["x"]}}, "needs a 'command'"),
])
def test_bad_servers_are_refused_at_cfg(tmp_path, servers, message):
    [problem] = config_problems(MultiTurnSettings(enable=True, tool_config_path=_config(tmp_path, servers)))
    assert message in problem and "tool_config_path" in problem
