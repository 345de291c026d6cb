"""verl's SandboxFusionTool (rlhf/agent/sandbox_tool.py) in the agent loop: verl's tool config, as written but for
the URL, runs the model's code in the real local sandbox (rlhf/sandbox) and its stdout is the tool message."""
from __future__ import annotations

import json

import pytest
import yaml

from rlhf.agent.config import MultiTurnSettings, config_problems, load_tool_specs
from rlhf.agent.loop import AgentLoop
from rlhf.agent.sandbox_tool import NO_STDOUT, SandboxFusionTool
from rlhf.agent.tools import build_tools
from rlhf.rollout.sampling import SamplingConfig
from tests.support.agent_fakes import ScriptedFleet, tool_call

#: verl's examples/sglang_multiturn/config/tool_config/sandbox_fusion_tool_config.yaml, verbatim
VERL_TOOL_CONFIG = """\
tools:
  - class_name: "verl.tools.sandbox_fusion_tools.SandboxFusionTool"
    config: 
      sandbox_fusion_url: "https://xxx.apigateway-cn-beijing.volceapi.com/run_code"
      num_workers: 10
      enable_global_rate_limit: true
      rate_limit: 10
      default_timeout: 30
      default_language: "python"
      memory_limit_mb: 1024
      type: native

    tool_schema:
      type: "function"
      function:
        name: "code_interpreter"
        description: "A tool for executing code."
        parameters:
          type: "object"
          properties:
            code:
              type: "string"
              description: "The code to execute."
          required: ["code"]
"""
SCHEMA = {"type": "function", "function": {
    "name": "code_interpreter", "description": "A tool for executing code.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "The code."}},
                   "required": ["code"]}}}


@pytest.fixture(scope="module")
def tool_config(tmp_path_factory):
    """verl's sandbox_fusion_tool_config.yaml with ``sandbox_fusion_url: local`` (verl's holds a cloud URL)."""
    cfg = yaml.safe_load(VERL_TOOL_CONFIG)
    cfg["tools"][0]["config"]["sandbox_fusion_url"] = "local"
    cfg["tools"][0]["config"]["default_timeout"] = 3
    path = tmp_path_factory.mktemp("tools") / "sandbox_fusion_tool_config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.fixture(scope="module")
def tools(tool_config):
    return build_tools(load_tool_specs(tool_config))


def _run(tok, tools, code: str, limit: int = 2000, **kw):
    """One trajectory whose first turn calls code_interpreter with ``code``; the tool message's text and metrics."""
    call = tool_call("code_interpreter", json.dumps({"code": code, **kw}))
    fleet = ScriptedFleet(tok, lambda turn, p: call if turn == 0 else "done")
    agent = AgentLoop(MultiTurnSettings(enable=True, max_tool_response_length=limit, tool_response_truncate_side="left"),
                      tok, 2000, tools=tools)
    [s], m = agent.run(fleet.generate, [{"raw_prompt": "Compute.", "extra_info": {}}],
                       SamplingConfig(max_new_tokens=1))
    a, b = s.extra["model_spans"][0][1], s.extra["model_spans"][1][0]
    text = tok.decode(s.response_ids[a:b])
    head, tail = "<|im_start|>tool\n", "<|im_end|>\n<|im_start|>assistant\n"
    assert text.startswith(head) and text.endswith(tail) and s.extra["response_mask"][a:b] == [0] * (b - a)
    return text[len(head):-len(tail)], m


def test_verl_config_builds_our_tool_on_the_local_sandbox(tools, tool_config):
    [tool] = tools.values()
    assert isinstance(tool, SandboxFusionTool) and list(tools) == ["code_interpreter"]
    assert tool.num_workers == 10 and tool.rate_limit == 10 and tool.memory_limit_mb == 1024
    assert tool.default_timeout == 3 and tool.sandbox_fusion_url.startswith("http://127.0.0.1:")
    assert config_problems(MultiTurnSettings(enable=True, tool_config_path=tool_config)) == []


def test_code_runs_in_the_sandbox_and_stdout_is_the_tool_message(tok, tools):
    text, m = _run(tok, tools, "print(sum(k * k for k in range(10)))\nprint('x' * 3)")
    assert text == "285\nxxx\n"
    assert m["tool_calls/success_rate"] == 1.0 and m["tool_calls/errors"] == 0


def test_stderr_follows_stdout_and_a_timeout_is_verls_message(tok, tools):
    text, _ = _run(tok, tools, "import sys\nprint('out')\nsys.exit('boom')")
    assert text == "out\nboom\n"  # verl: stdout + stderr of a finished run, whatever its return code
    # a call's timeout above default_timeout (3 s) is capped; the endless loop is killed at 1 s
    text, m = _run(tok, tools, "while True:\n    pass", timeout=1)
    assert text == NO_STDOUT and m["tool_calls/latency_s/max"] < 2.9


def test_huge_output_is_cut_and_a_bad_language_is_a_message(tok, tools):
    text, m = _run(tok, tools, "print('ab' * 500000)", limit=30)
    assert text == "ab" * 15 + "...(truncated)" and m["tool_calls/truncated_responses"] == 1
    text, m = _run(tok, tools, "class A {}", language="java")  # a SandboxFusion language this sandbox does not run
    assert text.startswith("Error when executing tool: RuntimeError: the sandbox at ") and "could not run the code: " \
        "language 'java' is not supported by the local sandbox" in text, text
    assert m["tool_calls/exceptions"] == 1


def test_unreachable_sandbox_is_a_message_and_a_counter(tok):
    tool = SandboxFusionTool({"sandbox_fusion_url": "http://127.0.0.1:9/run_code", "default_timeout": 1}, SCHEMA)
    text, m = _run(tok, {"code_interpreter": tool}, "print(1)")
    assert text.startswith("Error when executing tool: RuntimeError: the sandbox at http://127.0.0.1:9/run_code "
                           "did not run the code: API Call Failed")
    assert m["tool_calls/exceptions"] == 1 and m["tool_calls/success_rate"] == 0.0


@pytest.mark.parametrize("key, value, message", [
    ("num_workers", 0, "num_workers=0 must be an integer >= 1"),
    ("default_timeout", "30s", "default_timeout='30s' must be a number of seconds > 0"),
    ("sandbox_fusion_url", "sandbox:8080", "sandbox_fusion_url='sandbox:8080' must be an http(s) URL"),
])
def test_bad_config_is_refused_at_cfg(tmp_path, key, value, message):
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump({"tools": [{"class_name": "verl.tools.sandbox_fusion_tools.SandboxFusionTool",
                                               "config": {key: value}, "tool_schema": SCHEMA}]}))
    [problem] = config_problems(MultiTurnSettings(enable=True, tool_config_path=str(path)))
    assert message in problem and "tool_config_path" in problem
