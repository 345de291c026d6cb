"""The trainer's side of the rollout: SGLang engines on global rank 0, collective generation and scoring,
the weight sync, and the colocated engine lifecycle -- one code path on CPU and GPU.

Lifecycle of a PPO step (colocated; every call is a no-op where it does not apply, e.g. disaggregated)::

    with rollout.serving():  generate + score      # engines resident; released when the block ends
    train ...                                      # the trainer has the devices
    rollout.sync_weights()                         # resume weights -> sync -> re-sync replaced engines
                                                   # -> resume KV cache: engines serve again (validation)
    (or, when the actor did not change: nothing; the next serving() / ensure_resident() syncs released weights)

Released weights are gone (SGLang's memory saver keeps no CPU copy), so the next generation after a step that
released them and did not sync (critic warm-up, a batch with nothing to learn from) starts with a sync
(:meth:`RolloutWorker.ensure_resident`, called by ``serving()`` and by the trainer's validation): the engines'
resumed memory would otherwise generate garbage on GPU (the manager refuses that generation:
rlhf.rollout.manager.WeightsDiscardedError).

SGLang's memory saver frees nothing on CPU, but the same calls run, so the CPU suite exercises the GPU
order.  Every method is collective over all trainer ranks: rank 0 talks to the engines (a
:class:`~rlhf.rollout.manager.RolloutManager` over Ray); all ranks take part in the weight sync.  An
engine replaced after a crash serves the checkpoint it was started from, so it is synced again before it
generates: in :meth:`RolloutWorker.generate` when no fresh engine is left, and after every sync.

    rollout = RolloutWorker(cfg, model_path, actor_bundle, tokenizer)
    samples, scores, reward_metrics = rollout.generate(batch, sampling, reward, seed=None)
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from contextlib import contextmanager
from concurrent.futures import Future, ThreadPoolExecutor
from typing import List, Optional

import torch
import torch.distributed as dist

from rlhf.rollout.types import FINISH_ABORT, FINISH_LENGTH

from .lora_reference import adapter_sync_settings

logger = logging.getLogger(__name__)

__all__ = ["RolloutWorker", "start_rollout", "build_agent_loop", "agent_extra_info"]


def build_agent_loop(cfg, tokenizer):
    """The agent loop of ``rollout.multi_turn`` (rlhf.agent): verl's tool / interaction config files read, their
    classes built, responses up to data.max_response_length."""
    from rlhf.agent.config import MultiTurnSettings, load_interaction_specs, load_tool_specs
    from rlhf.agent.interactions import build_interactions
    from rlhf.agent.loop import AgentLoop
    from rlhf.agent.tools import build_tools

    s = MultiTurnSettings.from_config(cfg.rollout.multi_turn)
    tools = build_tools(load_tool_specs(s.tool_config_path)) if s.tool_config_path else {}
    interactions = build_interactions(load_interaction_specs(s.interaction_config_path)) \
        if s.interaction_config_path else {}
    kwargs = cfg.data.get("chat_template_kwargs")
    from rlhf.rollout.engine_args import rollout_context_length

    return AgentLoop(s, tokenizer, cfg.data.max_response_length, tools=tools, interactions=interactions,
                     template_kwargs=dict(kwargs) if kwargs else None,
                     max_context=rollout_context_length(cfg.data.max_prompt_length, cfg.data.max_response_length))


def agent_extra_info(sample) -> dict:
    """What verl's reward managers add to a multi-turn sample's ``extra_info``: ``num_turns``, ``tool_rewards``,
    ``turn_scores``, ``rollout_reward_scores`` (verl/experimental/reward_loop/reward_manager/naive.py)."""
    e = sample.extra
    return {"num_turns": e.get("num_turns"), "tool_rewards": list(e.get("tool_rewards", [])),
            "turn_scores": list(e.get("turn_scores", [])), "rollout_reward_scores": {}}


def _trajectory_metrics(samples: list) -> dict:
    """The agent loop's metrics that its samples hold (rlhf.agent.loop.AgentLoop._metrics' definitions):
    ``num_turns/{mean,max,min}``, ``tool_calls/mean`` (one tool reward per call), ``multi_turn/{truncated,aborted,
    tool_reward/mean}``; for the trajectories that fully async's rollouter generated."""
    n = max(len(samples), 1)
    turns = [float(x.extra.get("num_turns", 0)) for x in samples] or [0.0]
    rewards = [list(x.extra.get("tool_rewards", [])) for x in samples]
    return {"num_turns/mean": sum(turns) / n, "num_turns/max": max(turns), "num_turns/min": min(turns),
            "tool_calls/mean": sum(len(r) for r in rewards) / n,
            "multi_turn/truncated": float(sum(x.finish_reason == FINISH_LENGTH for x in samples)),
            "multi_turn/aborted": float(sum(x.finish_reason == FINISH_ABORT for x in samples)),
            "multi_turn/tool_reward/mean": sum(sum(r) for r in rewards) / n}


def _broadcast(obj, group):
    """Rank 0's ``obj`` on every rank, through ``group`` (the worker's host group, :attr:`RolloutWorker.host_group`)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def rollout_engine_config(cfg, model_path: str, device: str) -> dict:
    """The RolloutManager's ``engine_config`` of ``cfg`` (:func:`rlhf.rollout.engine_args.engine_kwargs`'s
    arguments): TP, dtype, memory fraction, context length, KV tokens and seed from the config, and
    ``rollout.engine_kwargs.sglang`` (verl's actor_rollout_ref.rollout.engine_kwargs.sglang.*) as
    ``engine_overrides``, passed to ``sglang.Engine`` as given (checked against SGLang's ServerArgs at start-up:
    rlhf.rollout.engine_args.server_args_problems).  ``device``: "cpu" or "cuda"."""
    from omegaconf import OmegaConf

    from rlhf.rollout.engine_args import batch_kv_tokens, resolve_engine_dtype, rollout_context_length

    r = cfg.rollout
    extra = r.get("engine_kwargs", {}).get("sglang", {})
    extra = OmegaConf.to_container(extra, resolve=True) if OmegaConf.is_config(extra) else dict(extra)
    lora, _ = adapter_sync_settings(cfg, model_path)
    if lora is not None:  # the engines take the actor's adapters (WeightBridge)
        from parallel.lora_export import peft_target_modules

        extra = dict(enable_lora=True, max_lora_rank=lora.rank, lora_target_modules=peft_target_modules(lora.targets), **extra)
    return dict(model_path=model_path, tp_size=r.tensor_model_parallel_size, device=device,
                dtype=resolve_engine_dtype(r.dtype, cfg.model.dtype),
                mem_fraction_static=r.mem_fraction_static, enable_memory_saver=r.enable_memory_saver,
                context_length=rollout_context_length(cfg.data.max_prompt_length, cfg.data.max_response_length),
                max_total_tokens=r.max_total_tokens or batch_kv_tokens(
                    cfg.data.train_batch_size, r.n, cfg.data.max_prompt_length, cfg.data.max_response_length,
                    r.num_engines, val_prompts=cfg.data.val_batch_size, val_n=r.val_kwargs.n),
                random_seed=cfg.trainer.seed,
                # MoE routing replay R3: each token's routed experts with every response (SGLang's capture)
                **({"enable_return_routed_experts": True} if r.get("enable_rollout_routing_replay") else {}),
                engine_overrides=extra)


def start_rollout(cfg, model_path: str):
    """Ray (the cluster at RAY_ADDRESS, else a local one) and a RolloutManager of ``rollout.num_engines``
    SGLang engines serving ``model_path``, placed per ``rollout.mode`` (rlhf/rollout/placement.py): on GPU by
    the plan (colocated on the trainer's GPUs of every node, disaggregated after the trainer's, each plan node
    pinned to its Ray node); on CPU a disaggregated engine goes to a Ray node other than trainer rank 0's when the
    cluster has several, a colocated one to the node of the trainer rank that serves it in the weight sync.  Rank 0 only; prints where the engines go.  Returns once the engines
    are launched: they come up in the background, and the manager's first call waits for them."""
    import ray

    from parallel.distributed import compute_device, rank_nodes
    from rlhf.rollout import RolloutManager
    from rlhf.rollout.placement import (cpu_engine_nodes, describe_engine_nodes, gpu_engine_nodes, plan_placement,
                                        rank_ray_nodes)
    from rlhf.rollout.ray_cluster import init_ray

    init_ray()
    r = cfg.rollout
    # before the process group exists (RolloutWorker.launch in a one-process job): that one process
    world = dist.get_world_size() if dist.is_initialized() else 1
    ray_nodes = [n for n in ray.nodes() if n.get("Alive")]
    ranks = rank_ray_nodes(rank_nodes(), ray_nodes, ray.get_runtime_context().get_node_id(), world)
    plan = None
    if torch.cuda.is_available() and r.get("n_gpus_per_node") and r.mode == "disaggregated":
        plan, node_ids = _pool_plan(cfg, world, ranks, ray_nodes)
    elif torch.cuda.is_available():
        per_node = torch.cuda.device_count()
        nnodes, node_ids = gpu_engine_nodes(ranks, per_node, ray_nodes, r.mode)
        plan = plan_placement(nnodes=nnodes, gpus_per_node=per_node, trainer_world_size=world,
                              num_engines=r.num_engines, engine_tp=r.tensor_model_parallel_size, mode=r.mode)
    else:
        node_ids = cpu_engine_nodes(ranks, ray_nodes, r.mode, r.num_engines, r.tensor_model_parallel_size)
    logger.info("[rollout] %s: %s (%d Ray node(s))", r.mode, describe_engine_nodes(r.num_engines, node_ids, ray_nodes,
                                                                                    plan), len(ray_nodes))
    engine_config = rollout_engine_config(cfg, model_path, compute_device().type)
    manager = RolloutManager(r.num_engines, engine_config, placement=r.mode, max_restarts=r.max_restarts, plan=plan,
                             node_ids=node_ids, start=False)
    manager.launch()
    return manager


def _pool_plan(cfg, world: int, ranks, ray_nodes):
    """GPU: (plan, Ray node ids by plan node) of verl's trainer and rollout pools
    (:func:`rlhf.rollout.placement.pool_placement`): plan node k is the Ray node of trainer ranks ``k x
    trainer.n_gpus_per_node ...``, then the other Ray nodes with GPUs (rollout-only nodes), by name.

    Raises:
        PlacementError: the pools do not fit this node's GPUs, or fewer Ray nodes than they need."""
    from rlhf.rollout.placement import PlacementError, gpu_engine_nodes, pool_nodes, pool_placement

    r, t = cfg.rollout, cfg.trainer
    per_node, trainer_per_node = torch.cuda.device_count(), t.n_gpus_per_node or world // (t.nnodes or 1)
    sizes = dict(trainer_nnodes=t.nnodes or 1, trainer_per_node=trainer_per_node, rollout_nnodes=r.nnodes or 1,
                 rollout_per_node=r.n_gpus_per_node)
    plan = pool_placement(gpus_per_node=per_node, engine_tp=r.tensor_model_parallel_size, **sizes)
    _, node_ids = gpu_engine_nodes(ranks, trainer_per_node, ray_nodes, r.mode)
    need = pool_nodes(per_node, **sizes)
    if len(node_ids) < need:
        raise PlacementError(f"verl's pools (trainer.nnodes={sizes['trainer_nnodes']} x trainer.n_gpus_per_node="
                             f"{trainer_per_node}, rollout.nnodes={sizes['rollout_nnodes']} x rollout.n_gpus_per_node="
                             f"{r.n_gpus_per_node}) on nodes of {per_node} GPUs need {need} nodes, but the Ray cluster "
                             f"has {len(node_ids)} with GPUs for them: join the rollout nodes to the Ray cluster "
                             f"(ray start --address=<head>:6379) before the run starts")
    return plan, node_ids


class RolloutWorker:
    """Collective: engines started on global rank 0 (``manager``; None elsewhere) and the weight bridge from
    ``actor_bundle`` (parallel.models.ModelBundle) into them on every rank; ``tokenizer`` decodes responses
    for the reward.  ``manager``: rank 0's engines when :meth:`launch` started them already (while the trainer
    built its models), else they are started here."""

    @staticmethod
    def launch(cfg, model_path: Optional[str] = None):
        """Global rank 0: :func:`start_rollout` now, when the engines' memory does not depend on what the trainer
        will allocate (:func:`rlhf.rollout.placement.engines_start_early`), so they start while the trainer
        imports and builds its models; the result goes to the constructor's ``manager``.  Also callable before
        the process group exists (``rlhf.trainer.run``): then only for a one-process job whose model is a local
        directory already (``model_path`` None: :func:`rlhf.quickstart.resolve.local_model_path`; nothing is
        built or downloaded here).  None on other ranks and otherwise.

        Why one process: with several ranks, Ray started before the process group made rank 0 abort at exit
        (a C++ ``std::system_error`` "Broken pipe" reaching Ray's terminate handler during ``ray.shutdown``, after
        the run's last step; tests/e2e/test_model_families_ppo.py's PP2 run, every time); a job of several ranks
        (on one or more nodes) launches its engines once the process group exists, while its models build."""
        from parallel.distributed import compute_device
        from rlhf.launch_env import launch_env
        from rlhf.rollout.placement import engines_start_early

        launched = None if dist.is_initialized() else launch_env()
        rank = dist.get_rank() if launched is None else launched.rank
        if rank != 0 or not engines_start_early(cfg.rollout.mode, compute_device().type):
            return None
        if not dist.is_initialized():
            from rlhf.quickstart.resolve import local_model_path

            one_process = (launched.world_size or 1) == 1 and (cfg.trainer.nnodes or 1) == 1
            model_path = local_model_path(cfg) if one_process else None
            if model_path is None:
                return None
        return start_rollout(cfg, model_path)

    def __init__(self, cfg, model_path: str, actor_bundle, tokenizer, manager=None):
        from rlhf.weight_bridge import WeightBridge, WeightSyncConfig
        from rlhf.rollout import SamplingConfig
        from rlhf.rollout.sampling import stop_token_ids_for

        self.cfg, self.tokenizer = cfg, tokenizer
        self.rank0 = dist.get_rank() == 0
        stop_ids = stop_token_ids_for(model_path)
        r = cfg.rollout
        self.train_sampling = SamplingConfig(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                             max_new_tokens=cfg.data.max_response_length, stop_token_ids=stop_ids)
        v = r.val_kwargs
        self.val_sampling = SamplingConfig(n=v.n, temperature=v.temperature, top_p=v.top_p, top_k=v.top_k,
                                           max_new_tokens=cfg.data.max_response_length, stop_token_ids=stop_ids)
        # every wait of the ranks other than 0 on rank 0 (engine start, generation and scoring: minutes) is on the
        # host, in a gloo group: on the default group (NCCL on a GPU run) each rank would wait in an NCCL kernel
        # spinning on its GPU, which a colocated engine rank shares (time-sliced against it for the whole generation)
        self.host_group = dist.new_group(backend="gloo")
        self.manager = (manager if manager is not None else start_rollout(cfg, model_path)) if self.rank0 else None
        dist.barrier(group=self.host_group)
        # LoRA synced as adapters (bridge.py), or merged (lora.merge, or the MoE-expert fallback: adapter_sync_settings)
        adapters, merged_fallback = adapter_sync_settings(cfg, model_path)
        self.bridge = WeightBridge(actor_bundle.chunks, actor_bundle.spec, self.manager, WeightSyncConfig(
            transport="tensor" if r.mode == "colocated" else "distributed", bucket_bytes=r.weight_sync_bucket_mb << 20,
            check="sample" if r.weight_sync_check else None, master_address=r.weight_update_address,
            lora=adapters, lora_merged_fallback=merged_fallback))
        # LoRA adapters (model.lora.merge false): the engines keep the frozen base weights between syncs (only
        # their KV cache is released), each sync sends the adapters alone
        self.release_tags = ["kv_cache"] if adapters is not None else None
        if r.mode == "colocated":  # the first sync imports SGLang's serializers (seconds): now, while engines start
            import sglang.srt.utils.common  # noqa: F401
        self.max_resyncs = r.max_restarts + 1
        self.last_sync = None
        self.colocated = r.mode == "colocated"
        # the engines do not hold the actor's weights (released and no sync refilled them since); at the start they
        # serve model.path's safetensors, which are not the actor's when it started from a megatron dist
        # checkpoint: the first ensure_resident() (before any generation) then syncs
        self.weights_released = bool(cfg.actor.get("use_dist_checkpointing"))
        self.bridge.base_sent = not self.weights_released  # LoRA's frozen base is model.path's: the engines hold it
        # context manager factory around every sync: the actor's parameters on its device while the bridge reads
        # them (the trainer sets the actor's MegatronWorker.resident when the actor's parameters are offloaded)
        self.actor_resident = contextlib.nullcontext
        # rollout.multi_turn.enable: rank 0 runs the agent loop (rlhf/agent) over the engines
        self.agent = build_agent_loop(cfg, tokenizer) if self.rank0 and cfg.rollout.multi_turn.enable else None
        self.multi_turn = bool(cfg.rollout.multi_turn.enable)
        self.fully_async = bool(cfg.async_training.enable)  # its rollouter may hand in finished trajectories
        self._pool = None  # generate_async's one background thread (rank 0), made on first use

    # ---- memory (colocated) ---------------------------------------------------------------------------
    def release(self) -> None:
        """Colocated: free the engines' weights and KV cache while the trainer computes."""
        if self.rank0:
            self.manager.release_memory_occupation(self.release_tags)
        self.weights_released = self.weights_released or (self.colocated and self.release_tags is None)
        dist.barrier(group=self.host_group)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def resume(self, tags: Optional[List[str]] = None) -> None:
        """Colocated: re-allocate the released ``tags`` (default all) once the trainer freed its cache."""
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        dist.barrier(group=self.host_group)  # every rank's cache is returned before the engines take memory again
        if self.rank0:
            self.manager.resume_memory_occupation(tags)
        dist.barrier(group=self.host_group)

    def ensure_resident(self) -> None:
        """Collective.  Engines ready to generate with the actor's weights: a plain resume when they kept their
        weights (or were never released), else a full :meth:`sync_weights`, since weights released since the last
        sync (a critic-warm-up step updates no actor and syncs nothing) come back as undefined memory."""
        if self.weights_released:
            self.sync_weights()
        else:
            self.resume()

    @contextmanager
    def serving(self):
        """Engines hold their memory, and the actor's weights, inside the block (ensure_resident ... release)."""
        self.ensure_resident()
        yield
        self.release()

    @contextmanager
    def released(self):
        """Collective.  Colocated engines' weights and KV cache freed for the block (a checkpoint save: megatron's
        distributed optimizer all-gathers its state over DP on the GPU, rlhf.memory_plan.planner.save_gather_bytes)
        and left released after it: the next :meth:`ensure_resident` (the next step's generation, or validation)
        resumes them and syncs the actor's weights, since SGLang's memory saver keeps no copy of released weights.
        Resuming at once would sync twice (now and after the next update) and put a sync between the save and the
        step's metrics.  Disaggregated engines hold other GPUs: nothing is done."""
        if not self.colocated:
            yield
            return
        self.release()
        if self.rank0:
            logger.info("[rollout] colocated engines released for the checkpoint save (the next generation resumes "
                        "and syncs them)")
        yield

    # ---- generation -----------------------------------------------------------------------------------
    def _generate(self, prompts: List[List[int]], sampling, started: Optional[Future] = None) -> Optional[list]:
        """Rank 0: ``sampling.n`` samples per prompt, prompt-major (None elsewhere); replaced engines are
        synced (collective) before they generate again.  ``started`` (rank 0): the first attempt, already running
        (:meth:`generate_async`); its result or error stands for the first ``manager.generate`` call."""
        from rlhf.rollout import StaleEnginesError

        done, todo = [], list(range(len(prompts)))
        for _ in range(self.max_resyncs + 1):
            stale = None
            if self.rank0:
                try:
                    first, started = started, None
                    out = first.result() if first is not None else self.manager.generate([prompts[i] for i in todo],
                                                                                        sampling)
                    done += self._renumber(out, todo)
                    todo = []
                except StaleEnginesError as e:
                    done += self._renumber(e.samples, todo)
                    todo, stale = [todo[i] for i in e.unfinished], e.engines
            stale = _broadcast(stale, self.host_group)
            if stale is None:
                return sorted(done, key=lambda s: (s.prompt_index, s.sample_index)) if self.rank0 else None
            with self.actor_resident():
                self.last_sync = self.bridge.sync(engines=stale)
        raise RuntimeError(f"rollout engines {stale} kept being replaced during generation; see the engine logs")

    def _retry_failed(self, samples, sampling) -> tuple:
        """Collective.  Samples whose generation failed (aborted request, no token, non-finite log-prob) are
        generated again greedily, each alone (rlhf.rollout.fallback); returns (samples, rank 0's counters
        rollout/num_fallbacks and rollout/num_failed_samples)."""
        from rlhf.rollout.fallback import failed_samples, greedy_retry_sampling, merge_retries

        failed = _broadcast(failed_samples(samples) if self.rank0 else None, self.host_group)
        if not failed:
            return samples, {"rollout/num_fallbacks": 0.0, "rollout/num_failed_samples": 0.0}
        retried = self._generate([samples[k].prompt_ids for k in failed], greedy_retry_sampling(sampling))
        return samples, (merge_retries(samples, failed, retried) if self.rank0 else {})

    @staticmethod
    def _renumber(samples, todo):
        for s in samples:
            s.prompt_index = todo[s.prompt_index]
        return list(samples)

    def generate_async(self, batch: dict, sampling, seed: int | None = None) -> Optional[Future]:
        """Rank 0: start generating for the prompts of ``batch`` (as :meth:`generate`) in a background thread and
        return at once: the engines are Ray actors in their own processes, so the trainer computes meanwhile (one
        step off-policy, rlhf.trainer.one_step_off).  None on other ranks.  Hand the result to :meth:`generate`
        (``started=``), which finishes the job (engine replacement, failed samples, reward) collectively.  Nothing
        else may use the engines (generate, sync weights, release) until then.  Not a collective."""
        if not self.rank0:
            return None
        if seed is not None:
            sampling = dataclasses.replace(sampling, seed=seed)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-async")
        prompts = [list(p) for p in batch["input_ids_list"]]
        return self._pool.submit(self.manager.generate, prompts, sampling)

    def generate(self, batch: dict, sampling, reward, seed: int | None = None,
                 started: Optional[Future] = None) -> tuple[list, list, dict]:
        """Collective.  Rank 0 generates for the prompts of ``batch`` (the trainer's collate: input_ids_list,
        data_source, ground_truth, extra_info, raw_prompt) with ``sampling`` (its seed replaced by ``seed`` when
        given) and scores the decoded responses with ``reward`` (rlhf.rewards.RewardManager; only rank 0's is
        used); every rank receives (samples, scores, reward metrics incl. reward/num_fallbacks and timing_s/reward,
        the seconds the scoring took).  ``started``: rank 0's :meth:`generate_async` of the same batch, sampling and
        seed (waited for here)."""
        if seed is not None:
            sampling = dataclasses.replace(sampling, seed=seed)
        if self.multi_turn:
            samples, rollout_metrics = self._generate_multi_turn(batch, sampling, started)
        else:
            samples = self._generate(batch["input_ids_list"], sampling, started)
            samples, rollout_metrics = self._retry_failed(samples, sampling)
        payload = None
        if self.rank0:
            texts = self.tokenizer.batch_decode([x.response_ids for x in samples], skip_special_tokens=True)
            idx = [x.prompt_index for x in samples]
            t0 = time.perf_counter()
            extra_infos = [batch["extra_info"][i] for i in idx]
            if self.multi_turn:  # verl's reward managers see the trajectory's tool fields in extra_info
                extra_infos = [{**(e or {}), **agent_extra_info(x)} for e, x in zip(extra_infos, samples)]
            scores, reward_metrics = reward.score(texts, [batch["data_source"][i] for i in idx],
                                                  [batch["ground_truth"][i] for i in idx],
                                                  extra_infos=extra_infos,
                                                  prompts=[batch["raw_prompt"][i] for i in idx])
            reward_metrics["timing_s/reward"] = time.perf_counter() - t0  # verl's timing_s/reward
            reward_metrics.update(rollout_metrics, **{"rollout/num_restarts": float(self.manager.num_restarts)})
            payload = (samples, scores, reward_metrics)
        return _broadcast(payload, self.host_group)

    def _generate_multi_turn(self, batch: dict, sampling, started: Optional[Future] = None) -> tuple[Optional[list],
                                                                                                  dict]:
        """Collective.  Rank 0 runs the agent loop (rlhf.agent.loop) for the prompts of ``batch``; engines replaced
        meanwhile (their trajectories end, multi_turn/aborted) are synced before the next generation.  Returns
        (rank 0's samples, its turn and tool metrics); None and {} elsewhere.  ``started`` (rank 0): the
        trajectories already generated (rlhf.trainer.fully_async runs the agent loop itself): taken as they are."""
        samples, metrics = (None, {})
        if self.fully_async and _broadcast(started is not None if self.rank0 else None, self.host_group):
            if not self.rank0:  # (the engines are the rollouter's: no re-sync here)
                return None, {}
            samples = started.result()
            return samples, _trajectory_metrics(samples)
        if self.rank0:
            rows = [{"raw_prompt": batch["raw_prompt"][i], "extra_info": batch["extra_info"][i],
                     "ground_truth": batch["ground_truth"][i]} for i in range(len(batch["raw_prompt"]))]
            samples, metrics = self.agent.run(self.manager.generate, rows, sampling)
        self.resync_replaced()
        return samples, metrics

    def resync_replaced(self) -> list:
        """Collective.  Push the actor's weights into the engines replaced (restarted after a crash) since the last
        sync that reached them -- they serve the checkpoint they started from -- and return their indices (every
        rank; empty: nothing sent).  Call it between generations, on every rank's main thread."""
        stale = _broadcast(self.manager.stale_engines() if self.rank0 else None, self.host_group)
        if stale:
            with self.actor_resident():
                self.last_sync = self.bridge.sync(engines=stale)
        return stale

    # ---- weights --------------------------------------------------------------------------------------
    def sync_weights(self):
        """Collective.  Push the actor's weights into every engine (colocated: weights re-allocated first, KV
        cache after), then re-sync engines replaced meanwhile.  Returns the full sync's SyncStats."""
        self.resume(["weights"])
        with self.actor_resident():
            stats = self.last_sync = self.bridge.sync()
            self.weights_released = False
            for _ in range(self.max_resyncs):
                stale = _broadcast(self.manager.stale_engines() if self.rank0 else None, self.host_group)
                if not stale:
                    break
                self.last_sync = self.bridge.sync(engines=stale)
        self.resume(["kv_cache"])
        return stats

    def close(self, finished: bool = False) -> None:
        """Close the weight bridge and shut the engines down.  ``finished`` (collective; every rank reached the
        run's end): the ranks wait for each other in between, so rank 0 stops the engines only once no rank maps
        their memory or is still in a weight-update group with them.  Not on an error: a rank may never arrive."""
        if self._pool is not None:  # a generation still running (an error mid-step) is left to the engines' end
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self.bridge is not None:
            self.bridge.close()
        if finished:
            dist.barrier(group=self.host_group)
        if self.manager is not None:
            self.manager.shutdown()
