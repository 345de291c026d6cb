"""verl's tool / interaction class names in a tool config (rlhf/agent/config.py): a misspelt name is an unknown
class with the nearest known name, not one of verl's real classes "without a port" (through --cfg:
tests/unit/config/test_verl_megatron.py::test_misspelt_tool_class_is_named_at_cfg)."""
import pytest

from rlhf.agent.config import resolve_class
from rlhf.agent.mcp_tool import MCPTool
from rlhf.agent.sandbox_tool import SandboxFusionTool
from rlhf.agent.search import SearchTool
from rlhf.agent.tools import Gsm8kTool


@pytest.mark.parametrize("typed,nearest", [
    ("verl.tools.gsm8k_tool.Gsm8KTool", "verl.tools.gsm8k_tool.Gsm8kTool"),
    ("verl.tools.gsm8k_tools.Gsm8kTool", "verl.tools.gsm8k_tool.Gsm8kTool"),
    ("verl.tools.serch_tool.SearchTool", "verl.tools.search_tool.SearchTool"),
    ("rlhf.agent.tools.Gsm8kTol", "rlhf.agent.tools.Gsm8kTool"),
])
def test_misspelt_tool_class_is_unknown_with_the_nearest_name(typed, nearest):
    with pytest.raises(ValueError) as e:
        resolve_class(typed, "tool")
    assert str(e.value).startswith(f"unknown tool class {typed!r}") and f"did you mean {nearest!r}?" in str(e.value)
    assert "has no port here" not in str(e.value)


def test_real_names_resolve_or_say_they_have_no_port():
    assert resolve_class("verl.tools.gsm8k_tool.Gsm8kTool", "tool") is Gsm8kTool
    assert resolve_class("verl.tools.search_tool.SearchTool", "tool") is SearchTool
    assert resolve_class("verl.tools.sandbox_fusion_tools.SandboxFusionTool", "tool") is SandboxFusionTool
    assert resolve_class("verl.tools.mcp_search_tool.MCPSearchTool", "tool") is MCPTool
    with pytest.raises(ValueError, match="'verl.tools.geo3k_tool.Geo3kTool' is verl's and has no port here"):
        resolve_class("verl.tools.geo3k_tool.Geo3kTool", "tool")
    with pytest.raises(ValueError, match="unknown interaction class 'verl.interactions.gsm8k_interaction.Gsm8k"
                       "Interacton': not one of verl's; did you mean 'verl.interactions.gsm8k_interaction."
                       "Gsm8kInteraction'"):
        resolve_class("verl.interactions.gsm8k_interaction.Gsm8kInteracton", "interaction")
    with pytest.raises(ValueError, match="tool class 'mypkg.Foo' does not import"):
        resolve_class("mypkg.Foo", "tool")

