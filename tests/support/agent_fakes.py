"""Test doubles of the agent loop (rlhf/agent): a scripted engine fleet whose responses are encoded one character
per token (ids a re-encoding of the decoded text would merge, so any decode / re-encode of the model's tokens shows),
and tools that fail in each way a tool can."""
from __future__ import annotations

import asyncio

from rlhf.agent.tools import BaseTool, ToolResponse
from rlhf.rollout.types import RolloutSample


class ScriptedFleet:
    """``generate(prompt_ids_list, sampling)`` of the engine fleet: request k's response is
    ``script(turn, prompt_ids)`` (turn: model turns before, counted by ``<|im_start|>assistant`` blocks), one token
    per character, EOS appended, cut at ``sampling.max_new_tokens`` (finish "length"); log-prob of token t is
    ``-0.01 * (t + 1) - 0.001 * call``.  Records every request in ``calls``: (prompt ids, output ids, log-probs,
    max_new_tokens), and each engine call's size in ``waves``."""

    def __init__(self, tokenizer, script):
        self.tok, self.script = tokenizer, script
        self.eos = tokenizer.eos_token_id
        self.assistant = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
        self.calls, self.waves = [], []

    def char_ids(self, text: str) -> list:
        return [i for ch in text for i in self.tok(ch, add_special_tokens=False)["input_ids"]]

    def turn(self, prompt: list) -> int:
        a, k = self.assistant, len(self.assistant)
        return sum(prompt[i:i + k] == a for i in range(len(prompt) - k + 1)) - 1

    def generate(self, prompts, sampling):
        self.waves.append(len(prompts))
        out = []
        for i, p in enumerate(prompts):
            ids = self.char_ids(self.script(self.turn(list(p)), list(p))) + [self.eos]
            reason = "stop"
            if len(ids) > sampling.max_new_tokens:
                ids, reason = ids[:sampling.max_new_tokens], "length"
            lps = [-0.01 * (t + 1) - 0.001 * len(self.calls) for t in range(len(ids))]
            self.calls.append((list(p), ids, lps, sampling.max_new_tokens))
            out.append(RolloutSample(list(p), ids, lps, reason, i, 0, weight_version=3))
        return out


#: verl's GSM8K tool schema (examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml)
GSM8K_SCHEMA = {"type": "function", "function": {
    "name": "calc_gsm8k_reward", "description": "A tool for calculating the reward of gsm8k.",
    "parameters": {"type": "object", "properties": {"answer": {"type": "string", "description": "The answer"}},
                   "required": ["answer"]}}}


def tool_call(name: str, arguments: str) -> str:
    """A hermes tool call of ``name`` with the JSON text ``arguments``."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


class RaisingTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        raise RuntimeError("sandbox unreachable")


class SlowTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.sleep(30)
        return ToolResponse(text="late"), 0.0, {}


class HugeTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text="".join(chr(ord("a") + k % 26) for k in range(5000))), 0.0, {}


class VersionedFleet(ScriptedFleet):
    """:class:`ScriptedFleet` whose weights have a version (``version``, bumped by the test's weight sync) and that
    continues a turn cut at ``max_new_tokens`` (a chunk of partial rollout: the prompt ends with the turn so far):
    token t of a turn has log-prob ``-(version + t / 100)`` and the sample the version.  ``before(prompt, turn)``:
    called first for each request (a test's hook to hold the engine).  ``calls``: (turn, tokens, version)."""

    def __init__(self, tokenizer, script, before=None):
        super().__init__(tokenizer, script)
        self.version, self.before = 0, before or (lambda prompt, turn: None)

    def generate(self, prompts, sampling):
        self.waves.append(len(prompts))
        out = []
        for i, p in enumerate(prompts):
            p, turn = list(p), self.turn(list(p))
            self.before(p, turn)
            a, k = self.assistant, len(self.assistant)
            start = max(j + k for j in range(len(p) - k + 1) if p[j:j + k] == a)
            done = len(p) - start  # tokens of this turn generated before (an earlier chunk)
            full = self.char_ids(self.script(turn, p)) + [self.eos]
            ids = full[done:done + sampling.max_new_tokens]
            reason = "stop" if done + len(ids) == len(full) else "length"
            lps = [-(self.version + (done + t) / 100) for t in range(len(ids))]
            self.calls.append((turn, ids, self.version))
            out.append(RolloutSample(p, ids, lps, reason, i, 0, weight_version=self.version))
        return out
