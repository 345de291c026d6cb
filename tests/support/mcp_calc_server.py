"""A local MCP server over stdio for the MCP tool tests (tests/unit/agent/test_mcp_tool.py): ``add`` and ``fail``."""
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

app = MCPServer("calc")


@app.tool()
def add(a: int, b: int) -> str:
    """Add two integers."""
    return str(a + b)


@app.tool()
def fail(reason: str) -> str:
    """Always fails (a ToolError: its message goes to the client)."""
    raise ToolError(f"refused: {reason}")


@app.tool()
def hidden() -> str:
    """Not in the tool_selected_list."""
    return "x"


if __name__ == "__main__":
    app.run()
