"""The agent loop: multi-turn rollouts with tools over the rollout engines, verl's ToolAgentLoop
(verl/experimental/agent_loop/tool_agent_loop.py) on asyncio.

Every trajectory (prompt x ``rollout.n``) is a coroutine; its generation requests go to one batcher that sends all
requests waiting at that moment to the engines as one call (``generate(prompt_ids_list, sampling)``: the fleet's
typed generate, run in a worker thread) while tool calls, interactions and template rendering of the other
trajectories run, so turns of different trajectories interleave and nothing waits for a whole batch's turn.

Token in, token out: a trajectory's sequence is its prompt ids followed by, turn after turn, exactly the ids the
engine generated (``response_mask`` 1, the engine's log-probs kept) and the ids of the tool / user messages from
the chat template's incremental rendering (rlhf.agent.render; ``response_mask`` 0, log-prob 0).  Model tokens are
decoded only to parse tool calls and to give the template the conversation, never re-encoded.

Limits (verl's): the whole response (model + tool tokens) fits ``max_response_length`` (a turn generates at most
what is left, and ``max_tokens_per_turn``); a tool / user message that does not fit ends the trajectory, which is
then marked truncated, as is one whose last turn stopped at the length limit; ``max_assistant_turns`` /
``max_user_turns`` end it after so many turns.  Bad input from the model or a tool becomes the tool message the
model reads next plus a counter (module rlhf.agent.parsing; timeouts, exceptions, huge outputs, a tool's own
``metrics["error"]`` here), never an error of the trainer.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from rlhf.agent.config import MultiTurnSettings
from rlhf.agent.parsing import ParsedCall, ToolCallParser
from rlhf.agent.render import ChatRenderer
from rlhf.rollout.sampling import SamplingConfig
from rlhf.rollout.types import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, RolloutSample

__all__ = ["AgentLoop", "truncate_tool_text", "ERROR_KINDS"]
log = logging.getLogger(__name__)

#: counters of bad tool calls (``tool_calls/<kind>``)
ERROR_KINDS = ("parse_errors", "unknown_tool", "invalid_arguments", "timeouts", "exceptions", "tool_errors")
_KIND = {"parse_error": "parse_errors", "unknown_tool": "unknown_tool", "invalid_arguments": "invalid_arguments"}


def truncate_tool_text(text: str, limit: int, side: str) -> str:
    """verl's cut of a tool response longer than ``limit`` characters: "left" keeps the first ``limit`` characters,
    "right" the last, "middle" ``limit // 2`` of each end, with a "(truncated)" marker where text was cut."""
    if len(text) <= limit:
        return text
    if side == "left":
        return text[:limit] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-limit:]
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[-half:]


class _Aborted(Exception):
    """The engines could not serve the request (every engine replaced during the call)."""


@dataclass
class _Trajectory:
    prompt_index: int
    sample_index: int
    messages: list
    prompt_ids: list
    tools_kwargs: dict
    interaction: Any = None
    interaction_kwargs: dict = field(default_factory=dict)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    response_ids: list = field(default_factory=list)
    mask: list = field(default_factory=list)
    logps: list = field(default_factory=list)
    versions: list = field(default_factory=list)  # weight version per response token (tool tokens: the last turn's)
    spans: list = field(default_factory=list)  # [start, end) of each model turn in response_ids
    assistant_turns: int = 0
    user_turns: int = 0
    tool_rewards: list = field(default_factory=list)
    turn_scores: list = field(default_factory=list)
    finish: str = FINISH_STOP
    truncated: bool = False
    weight_version: int = 0


class _Batcher:
    """Collects the requests of all trajectories and serves them in waves, one engine call per max_new_tokens."""

    def __init__(self, generate: Callable, sampling: SamplingConfig, executor):
        self.generate, self.sampling, self.executor = generate, sampling, executor
        self.queue: list = []
        self.event = asyncio.Event()
        self.waves = 0

    async def request(self, ids: list, max_new_tokens: int) -> RolloutSample:
        fut = asyncio.get_running_loop().create_future()
        self.queue.append((ids, max_new_tokens, fut))
        self.event.set()
        return await fut

    def _wave(self, reqs: list) -> list:
        """Worker thread: the requests' samples (or an exception each), grouped by max_new_tokens."""
        from rlhf.rollout.manager import StaleEnginesError

        out: list = [None] * len(reqs)
        groups: dict = {}
        for k, (_, m, _) in enumerate(reqs):
            groups.setdefault(m, []).append(k)
        for m, idx in groups.items():
            seed = None if self.sampling.seed is None else self.sampling.seed + 1_000_003 * self.waves
            sampling = dataclasses.replace(self.sampling, n=1, max_new_tokens=m, seed=seed)
            try:
                samples = self.generate([reqs[k][0] for k in idx], sampling)
            except StaleEnginesError as e:
                samples = [None] * len(idx)
                for s in e.samples:
                    samples[s.prompt_index] = s
            except Exception as e:  # noqa: BLE001 - handed to every waiting trajectory, which re-raises it
                samples = [e] * len(idx)
            for k, s in zip(idx, samples):
                out[k] = s if s is not None else _Aborted()
        self.waves += 1
        return out

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self.event.wait()
            await asyncio.sleep(0)  # trajectories ready in this tick join the wave
            self.event.clear()
            reqs, self.queue = self.queue, []
            if not reqs:
                continue
            results = await loop.run_in_executor(self.executor, self._wave, reqs)
            for (_, _, fut), r in zip(reqs, results):
                if isinstance(r, BaseException):
                    fut.set_exception(r)
                else:
                    fut.set_result(r)


class AgentLoop:
    """Multi-turn rollouts (module docstring).

    Args:
        settings: ``rollout.multi_turn``.
        tokenizer: the model's tokenizer (its chat template renders prompts and tool / user messages).
        max_response_length: tokens of the whole response (model and tool tokens), data.max_response_length.
        tools: ``{function name: tool}`` (rlhf.agent.tools), interactions: ``{name: interaction}``.
        template_kwargs: extra arguments of the chat template (data.chat_template_kwargs).
        max_context: the engines' context length (data.max_prompt_length + max_response_length; None: no
            limit): a request's prompt and new tokens stay within it (a prompt that the tool schemas made longer
            than data.max_prompt_length leaves less for the response).
    """

    def __init__(self, settings: MultiTurnSettings, tokenizer: Any, max_response_length: int,
                 tools: Optional[dict] = None, interactions: Optional[dict] = None,
                 template_kwargs: Optional[dict] = None, max_context: Optional[int] = None):
        self.s, self.tokenizer, self.R = settings, tokenizer, int(max_response_length)
        self.max_context = max_context
        self.tools, self.interactions = dict(tools or {}), dict(interactions or {})
        schemas = [t.tool_schema for t in self.tools.values()]
        self.parser = ToolCallParser(schemas, settings.parser_name) if schemas else None
        self.renderer = ChatRenderer(tokenizer, schemas, template_kwargs)
        self._fallback_warned, self._call_errors_logged = False, set()

    # ---- public ------------------------------------------------------------------------------------
    def run(self, generate: Callable, rows: list[dict], sampling: SamplingConfig) -> tuple[list, dict]:
        """``sampling.n`` trajectories per row; ``rows[i]``: ``raw_prompt`` (messages or a string),
        ``extra_info`` (verl's ``tools_kwargs`` / ``interaction_kwargs``), ``ground_truth``.  ``generate``: the
        fleet's ``generate(prompt_ids_list, sampling) -> [RolloutSample]`` (called from one worker thread).

        Returns (samples prompt-major, each with ``extra["response_mask"]`` (1 on model tokens), ``num_turns``,
        ``tool_rewards``, ``turn_scores``, ``model_spans``, ``token_weight_versions`` (the weight version of each
        response token: a model token's from ``generate``'s ``extra["token_weight_versions"]`` or its sample's
        ``weight_version``, a tool / user token's that of the model token before it); metrics).  Raises what the
        engines raise other than a replaced engine (those trajectories end, counted in ``multi_turn/aborted``)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self._run(generate, rows, sampling))
        with concurrent.futures.ThreadPoolExecutor(1) as ex:  # called from inside an event loop: a thread of its own
            return ex.submit(asyncio.run, self._run(generate, rows, sampling)).result()

    # ---- the rollout -------------------------------------------------------------------------------
    async def _run(self, generate, rows, sampling):
        self.stats: dict = {k: 0.0 for k in ("calls", "ok", "latency", "latency_max", "truncated_responses",
                                             "turn_limit", "kwargs_fallbacks", *ERROR_KINDS)}
        self.renderer.fallbacks = 0
        trajs = [self._start(i, j, row) for i, row in enumerate(rows) for j in range(sampling.n)]
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            batcher = _Batcher(generate, sampling, ex)
            server = asyncio.ensure_future(batcher.serve())
            try:
                await asyncio.gather(*(self._trajectory(t, batcher) for t in trajs))
            finally:
                server.cancel()
        samples = [RolloutSample(t.prompt_ids, t.response_ids, t.logps, FINISH_LENGTH if t.truncated else t.finish,
                                 t.prompt_index, t.sample_index, t.weight_version,
                                 extra={"response_mask": t.mask, "num_turns": t.assistant_turns + t.user_turns + 1,
                                        "tool_rewards": t.tool_rewards, "turn_scores": t.turn_scores,
                                        "model_spans": t.spans, "token_weight_versions": t.versions})
                   for t in trajs]
        return samples, self._metrics(trajs, batcher.waves)

    def _fallback(self, what: str) -> None:
        self.stats["kwargs_fallbacks"] += 1
        if not self._fallback_warned:
            self._fallback_warned = True
            log.warning("a row has no %s: the row's ground truth / the only interaction is used (counted in "
                        "multi_turn/kwargs_fallbacks)", what)

    def _start(self, i: int, j: int, row: dict) -> _Trajectory:
        raw = row.get("raw_prompt")
        messages = [{"role": "user", "content": raw}] if isinstance(raw, str) else [dict(m) for m in raw]
        extra = row.get("extra_info") or {}
        tools_kwargs = dict(extra.get("tools_kwargs") or {})
        for name in self.tools:
            if name not in tools_kwargs and row.get("ground_truth") is not None:
                self._fallback(f"extra_info.tools_kwargs.{name}")
                tools_kwargs[name] = {"create_kwargs": {"ground_truth": row["ground_truth"]}}
        t = _Trajectory(i, j, messages, self.renderer.prompt(messages), tools_kwargs)
        if self.interactions:
            kw = dict(extra.get("interaction_kwargs") or {})
            if "name" not in kw:
                if len(self.interactions) > 1:
                    raise ValueError(f"row {i}: extra_info.interaction_kwargs has no 'name' and the interaction "
                                     f"config holds several ({sorted(self.interactions)}); name one per row")
                self._fallback("extra_info.interaction_kwargs.name")
                kw["name"] = next(iter(self.interactions))
            if kw["name"] not in self.interactions:
                raise ValueError(f"row {i}: interaction {kw['name']!r} is not in the interaction config "
                                 f"(available: {sorted(self.interactions)})")
            if "ground_truth" not in kw and row.get("ground_truth") is not None:
                self._fallback("extra_info.interaction_kwargs.ground_truth")
                kw["ground_truth"] = row["ground_truth"]
            t.interaction, t.interaction_kwargs = self.interactions[kw["name"]], kw
        return t

    def _append(self, t: _Trajectory, ids: list, logps: Optional[list], versions: Optional[list] = None) -> None:
        """Model tokens (``logps`` given): mask 1, their log-probs and weight versions (``versions``); tool / user
        tokens: mask 0, log-prob 0, the weight version of the model token before them."""
        t.response_ids += ids
        t.mask += [1 if logps is not None else 0] * len(ids)
        t.logps += list(logps) if logps is not None else [0.0] * len(ids)
        t.versions += list(versions) if versions is not None else [t.versions[-1] if t.versions else 0] * len(ids)

    async def _trajectory(self, t: _Trajectory, batcher: _Batcher) -> None:
        s = self.s
        if t.interaction is not None:
            await t.interaction.start_interaction(t.request_id, **t.interaction_kwargs)
        try:
            while True:
                left = self.R - len(t.response_ids)
                if self.max_context is not None:
                    left = min(left, self.max_context - len(t.prompt_ids) - len(t.response_ids))
                if left <= 0:
                    t.truncated = True
                    return
                try:
                    out = await batcher.request(t.prompt_ids + t.response_ids, min(left, s.max_tokens_per_turn or left))
                except _Aborted:
                    t.finish = FINISH_ABORT
                    return
                start = len(t.response_ids)
                # a turn generated in chunks across a weight sync (rlhf.trainer.fully_async) has a version per token
                versions = (out.extra or {}).get("token_weight_versions") or [out.weight_version] * len(
                    out.response_ids)
                self._append(t, list(out.response_ids), list(out.response_log_probs), versions)
                t.spans.append((start, len(t.response_ids)))
                t.assistant_turns += 1
                if t.assistant_turns == 1:  # the version of the trajectory's first token (its staleness)
                    t.weight_version = versions[0] if versions else out.weight_version
                if out.finish_reason != FINISH_STOP:
                    t.finish, t.truncated = out.finish_reason, out.finish_reason == FINISH_LENGTH
                    return
                if len(t.response_ids) >= self.R:
                    return
                if (s.max_assistant_turns and t.assistant_turns >= s.max_assistant_turns) or \
                        (s.max_user_turns and t.user_turns >= s.max_user_turns):
                    self.stats["turn_limit"] += 1
                    return
                text = self.tokenizer.decode(out.response_ids, skip_special_tokens=True)
                calls = self.parser.parse(text)[1] if self.parser is not None else []
                assistant = {"role": "assistant", "content": text}
                stop = False
                if calls:
                    new = await self._tools(t, calls)
                elif t.interaction is not None:
                    stop, reply, score, _ = await t.interaction.generate_response(
                        t.request_id, t.messages + [assistant], **t.interaction_kwargs)
                    if score is not None:
                        t.turn_scores.append(float(score))
                    new = [{"role": "user", "content": reply}]
                else:
                    return
                ids = self.renderer.delta(t.messages + [assistant], new)
                t.messages += [assistant] + new
                if len(t.response_ids) + len(ids) >= self.R:
                    t.truncated = True
                    return
                self._append(t, ids, None)
                t.user_turns += 1
                if stop:
                    return
        finally:
            if t.interaction is not None:
                await t.interaction.finalize_interaction(t.request_id)

    async def _tools(self, t: _Trajectory, calls: list[ParsedCall]) -> list[dict]:
        """The tool messages of one model turn: the first ``max_parallel_calls`` calls, run concurrently."""
        results = await asyncio.gather(*(self._call(t, c) for c in calls[:self.s.max_parallel_calls]))
        return [{"role": "tool", "content": text} for text in results]

    async def _call(self, t: _Trajectory, call: ParsedCall) -> str:
        """One call's response text (an error's description for bad calls, counted); its reward to the trajectory's
        ``tool_rewards`` (verl: 0.0 for a failed call)."""
        self.stats["calls"] += 1
        if call.error is not None:
            self.stats[_KIND[call.error]] += 1
            if call.error not in self._call_errors_logged:
                self._call_errors_logged.add(call.error)
                log.warning("a tool call of the model is bad (%s); the model reads the error (counted in "
                            "tool_calls/%s; logged once)", call.detail, _KIND[call.error])
            t.tool_rewards.append(0.0)
            return f"Error when executing tool: {call.detail}"
        tool, kwargs, timeout = self.tools[call.name], t.tools_kwargs.get(call.name, {}), self.s.tool_timeout_s
        instance, t0 = None, time.perf_counter()
        try:
            instance, _ = await asyncio.wait_for(tool.create(create_kwargs=kwargs.get("create_kwargs", {})), timeout)
            resp, reward, tool_metrics = await asyncio.wait_for(
                tool.execute(instance, call.arguments, **kwargs.get("execute_kwargs", {})), timeout)
            text = "" if resp is None or resp.text is None else str(resp.text)
            failed = isinstance(tool_metrics, dict) and bool(tool_metrics.get("error"))
        except asyncio.TimeoutError:
            self.stats["timeouts"] += 1
            t.tool_rewards.append(0.0)
            return f"Error when executing tool: {call.name} did not answer within {timeout:g} s"
        except Exception as e:  # noqa: BLE001 - a failing tool is the model's message, not the trainer's crash
            self.stats["exceptions"] += 1
            t.tool_rewards.append(0.0)
            return f"Error when executing tool: {type(e).__name__}: {e}"
        finally:
            latency = time.perf_counter() - t0
            self.stats["latency"] += latency
            self.stats["latency_max"] = max(self.stats["latency_max"], latency)
            if instance is not None:
                try:
                    await tool.release(instance)
                except Exception as e:  # noqa: BLE001
                    log.warning("tool %s: release failed: %s", call.name, e)
        # a tool that answered its own bad input (metrics["error"], e.g. the calculator's "Error: ...") is no success
        self.stats["tool_errors" if failed else "ok"] += 1
        t.tool_rewards.append(float(reward or 0.0))
        if len(text) > self.s.max_tool_response_length:
            self.stats["truncated_responses"] += 1
            text = truncate_tool_text(text, self.s.max_tool_response_length, self.s.tool_response_truncate_side)
        return text

    def _metrics(self, trajs: list, waves: int) -> dict:
        """verl's num_turns/{mean,max,min}; tool_calls/{mean,success_rate,errors,<error kind>,truncated_responses,
        latency_s/mean,latency_s/max}; multi_turn/{truncated,aborted,turn_limit,render_fallbacks,kwargs_fallbacks,
        waves,tool_reward/mean}."""
        st, n = self.stats, max(len(trajs), 1)
        turns = [t.assistant_turns + t.user_turns + 1 for t in trajs] or [0]
        errors = sum(st[k] for k in ERROR_KINDS)
        m = {"num_turns/mean": sum(turns) / n, "num_turns/max": float(max(turns)), "num_turns/min": float(min(turns)),
             "tool_calls/mean": st["calls"] / n, "tool_calls/errors": errors,
             "tool_calls/success_rate": st["ok"] / st["calls"] if st["calls"] else 0.0,
             "tool_calls/truncated_responses": st["truncated_responses"],
             "tool_calls/latency_s/mean": st["latency"] / max(st["ok"] + st["timeouts"] + st["exceptions"]
                                                              + st["tool_errors"], 1),
             "tool_calls/latency_s/max": st["latency_max"],
             **{f"tool_calls/{k}": st[k] for k in ERROR_KINDS},
             "multi_turn/truncated": float(sum(t.truncated for t in trajs)),
             "multi_turn/aborted": float(sum(t.finish == FINISH_ABORT for t in trajs)),
             "multi_turn/turn_limit": st["turn_limit"], "multi_turn/render_fallbacks": float(self.renderer.fallbacks),
             "multi_turn/kwargs_fallbacks": st["kwargs_fallbacks"], "multi_turn/waves": float(waves),
             "multi_turn/tool_reward/mean": sum(sum(t.tool_rewards) for t in trajs) / n}
        return m
