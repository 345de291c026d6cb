"""Multi-turn rollouts with tools (verl's ``actor_rollout_ref.rollout.multi_turn``): an asyncio agent loop over the
rollout engines (:mod:`rlhf.agent.loop`), verl's tool and interaction config files and classes
(:mod:`rlhf.agent.config`, :mod:`rlhf.agent.tools`, :mod:`rlhf.agent.interactions`), verl's SandboxFusionTool on
the local code sandbox (:mod:`rlhf.agent.sandbox_tool`) and SearchTool on a local BM25 retrieval
(:mod:`rlhf.agent.search`, also ``rlhf retrieval serve``), verl's MCP tools on local stdio MCP servers
(:mod:`rlhf.agent.mcp_tool`), tool-call parsing with SGLang's
FunctionCallParser (:mod:`rlhf.agent.parsing`) and the chat template's incremental rendering
(:mod:`rlhf.agent.render`).

Layer: called by rlhf.workers (RolloutWorker); calls rlhf.rewards (GSM8K scoring, verl's sandbox case runner),
rlhf.sandbox (the local sandbox) and rlhf.rollout (the engines' result type and sampling settings)."""
