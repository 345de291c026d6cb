"""Test doubles: in-memory engines behind the engines' handle protocol of rlhf.weight_bridge
(RolloutManager's), a simulated TP group for the weight sync in one process, and stand-ins for the
trainer's prompt loader and RolloutWorker."""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch

from parallel.convert import unwrap_model
from parallel.model_config import HFModelSpec
from rlhf.weight_bridge import normalize_expected
from rlhf.rollout.manager import assert_plain_data


def expected_weights_from_spec(spec: HFModelSpec, dtype=torch.float32) -> dict:
    """``{HF name: (shape, dtype)}`` of a Llama/Qwen2 checkpoint described by ``spec`` (what SGLang's loader
    accepts for it; tied models have no ``lm_head.weight``)."""
    H, d, I = spec.hidden_size, spec.head_dim, spec.ffn_hidden_size
    q, kv = spec.num_attention_heads * d, spec.num_query_groups * d
    w = {"model.embed_tokens.weight": (spec.vocab_size, H), "model.norm.weight": (H,)}
    if not spec.tie_word_embeddings:
        w["lm_head.weight"] = (spec.vocab_size, H)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                  p + "self_attn.q_proj.weight": (q, H), p + "self_attn.k_proj.weight": (kv, H),
                  p + "self_attn.v_proj.weight": (kv, H), p + "self_attn.o_proj.weight": (H, q),
                  p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                  p + "mlp.down_proj.weight": (H, I)})
        if spec.qkv_bias:
            w.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                      p + "self_attn.v_proj.bias": (kv,)})
    return {k: (tuple(v), dtype) for k, v in w.items()}


class FakeEngine:
    """One in-memory engine: SGLang's session rule, its payload deserialization (SafeUnpickler) and
    FlattenedTensorBucket reconstruction; keeps clones of what it loads in ``received`` (the last TP rank's) and
    per TP rank in ``by_rank``."""

    def __init__(self, expected: Mapping, tp_size: int, corrupt: Callable | None = None):
        self.expected, self.tp_size, self.corrupt = expected, tp_size, corrupt
        self.received: dict[str, torch.Tensor] = {}
        self.by_rank: list[dict[str, torch.Tensor]] = [{} for _ in range(tp_size)]
        self.calls: list[tuple[str, Any]] = []
        self.flushes = 0
        self.in_session = False

    def begin_weight_update(self):
        assert not self.in_session, "a weight-update session is already open"
        self.in_session = True

    def end_weight_update(self):
        assert self.in_session, "no session"
        self.in_session = False

    def update_weights_from_tensor(self, serialized_named_tensors, load_format="flattened_bucket", flush_cache=False):
        from sglang.srt.utils.common import MultiprocessingSerializer
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

        assert self.in_session, "update_weights_from_tensor outside a session"
        assert load_format == "flattened_bucket" and len(serialized_named_tensors) == self.tp_size
        names = None
        for r, payload in enumerate(serialized_named_tensors):  # every TP rank deserializes its own copy
            assert isinstance(payload, (bytes, str)), type(payload)
            obj = MultiprocessingSerializer.deserialize(payload)
            named = FlattenedTensorBucket(flattened_tensor=obj["flattened_tensor"],
                                          metadata=obj["metadata"]).reconstruct_tensors()
            names = [n for n, _ in named]
            for n, t in named:
                if n not in self.expected or tuple(t.shape) != self.expected[n][0]:
                    raise RuntimeError(f"engine crash: {n} {tuple(t.shape)}")
                self.received[n] = (self.corrupt(n, t) if self.corrupt else t).detach().clone()
                self.by_rank[r][n] = self.received[n]
        self.calls.append(("update_weights_from_tensor", names))
        self.flushes += bool(flush_cache)

    def flush_cache(self):
        self.flushes += 1

    def get_weights_by_name(self, name, truncate_size=100):
        t = self.received.get(name)
        return None if t is None else t.float()[:truncate_size].tolist()


class FakeEngines:
    """The engines' handle (RolloutManager's protocol) over ``n`` FakeEngines, synchronous.

    ``kill_at[(engine, call_number)]``: replace that engine when its update call number ``k`` (0-based,
    counted per engine) arrives, as the manager does after an actor death (fresh state, stale).
    ``fail_at[(engine, call_number)]``: that update call raises RuntimeError (the engine lives on).
    """

    def __init__(self, expected: Mapping, n: int = 1, tp_size: int = 1, corrupt: Callable | None = None,
                 kill_at: Sequence[tuple] = (), fail_at: Sequence[tuple] = ()):
        self.expected = normalize_expected(expected)
        self.num_engines, self.tp_size, self.corrupt = n, tp_size, corrupt
        self.engines = [FakeEngine(self.expected, tp_size, corrupt) for _ in range(n)]
        self.restarts, self.stale, self.kill_at, self.log = [0] * n, set(), set(kill_at), []
        self.fail_at = set(fail_at)
        self._updates = [0] * n

    def expected_weights(self):
        self.log.append("expected_weights")
        return dict(self.expected)

    def fingerprint(self):
        return (self.tp_size, self.num_engines, tuple(self.restarts))

    def begin_sync(self):
        return tuple(self.restarts)

    def replaced_since(self, token):
        return [i for i in range(self.num_engines) if self.restarts[i] != token[i]]

    def end_sync(self, token, engines=None):
        for i in range(self.num_engines) if engines is None else engines:
            if self.restarts[i] == token[i]:
                self.stale.discard(i)

    def stale_engines(self):
        return sorted(self.stale)

    def _start(self, pick, method, *args, engines=None, per_engine=None, **kwargs):
        targets = list(range(self.num_engines)) if engines is None else list(engines)
        if method.startswith("update_weights"):
            assert_plain_data(method, args, kwargs, per_engine)
        extra = list(per_engine) if per_engine is not None else [{}] * len(targets)
        out = []
        for i, kw in zip(targets, extra):
            self.log.append(method)
            if method == "update_weights_from_tensor":
                k = self._updates[i]
                self._updates[i] += 1
                if (i, k) in self.kill_at:
                    self.engines[i] = FakeEngine(self.expected, self.tp_size, self.corrupt)
                    self.restarts[i] += 1
                    self.stale.add(i)
                    out.append((i, None))
                    continue
                if (i, k) in self.fail_at:
                    raise RuntimeError(f"engine {i} refused update call {k}")
            out.append((i, pick(self.engines[i])(*args, **kwargs, **kw)))
        return out

    def wait(self, pending, what="call"):
        return [r for _, r in pending]

    # the EngineFleet methods the weight bridge calls (rlhf.rollout.engine)
    def begin_weight_update(self, engines=None):
        self._start(lambda e: e.begin_weight_update, "begin_weight_update", engines=engines)

    def start_weight_update(self, engines=None):
        return self._start(lambda e: e.begin_weight_update, "begin_weight_update", engines=engines)

    def end_weight_update(self, engines=None):
        return self.wait(self._start(lambda e: e.end_weight_update, "end_weight_update", engines=engines))

    def update_weights_from_tensor(self, payloads, engines=None, load_format="flattened_bucket", flush_cache=False):
        return self._start(lambda e: e.update_weights_from_tensor, "update_weights_from_tensor", engines=engines,
                           per_engine=[{"serialized_named_tensors": p} for p in payloads],
                           load_format=load_format, flush_cache=flush_cache)

    def load_lora_adapter(self, tensors, config, engines=None):
        """Each target engine's ``adapter`` becomes ``(tensors, config)``; ``fail_lora``: the call raises."""
        if getattr(self, "fail_lora", False):
            raise RuntimeError("load_lora_adapter_from_tensors failed: refused")
        for i in range(self.num_engines) if engines is None else engines:
            self.log.append("load_lora_adapter")
            self.engines[i].adapter = (dict(tensors), dict(config))
        return []

    def engine_parameters(self, engines=None):
        return [[dict(e.received)] for i, e in enumerate(self.engines) if engines is None or i in engines]

    def get_weights_by_name(self, name, truncate_size=100, engines=None):
        return self.wait(self._start(lambda e: e.get_weights_by_name, "get_weights_by_name", name,
                                     truncate_size=truncate_size, engines=engines))

    def flush_cache(self, engines=None):
        self._start(lambda e: e.flush_cache, "flush_cache", engines=engines)


class SimulatedTPTopology:
    """One process simulating a TP group of ``len(rank_chunks)`` ranks at PP 1: ``rank_chunks[r]`` are the
    chunks megatron TP rank r would hold (rank 0's are given to the bridge); ``gather`` returns every
    simulated rank's shard, so the bridge's real conversion and bucketing path runs without communication."""

    def __init__(self, rank_chunks: Sequence[Sequence[Any]]):
        self.rank_chunks = rank_chunks
        self.rank, self.world, self.controller = 0, 1, 0
        self.tp_size, self.tp_rank, self.pp_size, self.pp_rank = len(rank_chunks), 0, 1, 0
        self.active = self.is_leader = self.is_controller = True
        self._sd = [[unwrap_model(c).state_dict(keep_vars=True) for c in chunks] for chunks in rank_chunks]
        self.ep_size, self.expert_peer = 1, False
        self.object_collectives = self.code_collectives = 0  # pickled / tensor control collectives issued

    def init_collective(self):
        pass

    def gather(self, entry, pool=None, spec=None):
        return [sd[entry.chunk_index][entry.local_name].detach() for sd in self._sd]

    def all_gather_object(self, obj):
        self.object_collectives += 1
        return [obj]

    def broadcast_object(self, obj):
        self.object_collectives += 1
        return obj

    def all_gather_codes(self, codes):
        self.code_collectives += 1
        return [list(codes)]


def push_weights(engines, named: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int = 1 << 30,
                 flush: bool = True) -> int:
    """Push full HF-named tensors into every engine of a real RolloutManager the way the colocated weight
    sync does (FlattenedTensorBucket payloads in shared memory, bytes through Ray), inside one session.
    Returns the number of buckets."""
    from rlhf.weight_bridge.bucketing import BufferPool, TensorMeta, fill_buckets, plan_buckets
    from rlhf.weight_bridge.from_tensor import prepare_sharing, serialize_bucket

    prepare_sharing(torch.device("cpu"))
    named = [(n, t.detach().contiguous()) for n, t in named]
    plans = plan_buckets([TensorMeta(n, tuple(t.shape), t.dtype) for n, t in named], bucket_bytes)
    pool = BufferPool(max(p.nbytes for p in plans), shared=True)
    token = engines.begin_sync()
    engines.begin_weight_update()
    for plan, slot, buf in fill_buckets(iter(named), plans, pool):
        payloads = [serialize_bucket(buf, plan, engines.tp_size) for _ in range(engines.num_engines)]
        engines.wait(engines.update_weights_from_tensor(payloads, flush_cache=flush and plan is plans[-1]))
        pool.release(slot)
    engines.end_weight_update()
    engines.end_sync(token)
    pool.close()
    return len(plans)


class FakePromptLoader:
    """StatefulPromptLoader stand-in: `next_batch()` hands out the given batches in order."""

    def __init__(self, batches):
        self.batches = list(batches)

    def next_batch(self):
        return self.batches.pop(0)


class FakeRollout:
    """RolloutWorker stand-in (rlhf/workers/rollout.py): `generate` returns the canned
    (samples, scores, reward_metrics) results in order and records (batch, sampling, reward, seed)."""

    train_sampling, val_sampling = "train", "val"

    def __init__(self, results):
        self.results = list(results)
        self.calls = []
        self.synced = 0

    def generate(self, batch, sampling, reward, seed=None):
        self.calls.append((batch, sampling, reward, seed))
        return self.results.pop(0)

    def sync_weights(self):
        from rlhf.weight_bridge import SyncStats

        self.synced += 1
        return SyncStats()

    def ensure_resident(self):  # nothing is released by this stand-in's serving(): nothing to restore
        return None

    def serving(self):
        import contextlib

        return contextlib.nullcontext()

    def released(self):  # around a checkpoint save: nothing held by this stand-in
        import contextlib

        return contextlib.nullcontext()


class FakeActor:
    """MegatronActor / MegatronCritic stand-in: log-probs / values of zeros, updates recorded by step."""

    def __init__(self):
        from rlhf.workers.dynamic_batch import PaddingCounter

        self.updates = []
        self.padding = PaddingCounter()  # nothing processed: perf/padding_efficiency 1.0

    def compute_log_prob(self, batch):
        import torch

        return {"log_probs": torch.zeros(batch["response_mask"].shape)}

    def compute_values(self, batch):
        import torch

        return torch.zeros(batch["response_mask"].shape)

    def update_policy(self, batch, loss, step):
        self.updates.append(step)
        return {"actor/pg_loss": 0.5}

    def update_critic(self, batch, step):
        self.updates.append(step)
        return {"critic/vf_loss": 0.25}


class FakeRolloutManager:
    """RolloutManager stand-in for the trainer's RolloutWorker: the manager's memory semantics (a resume of
    what is not released is a no-op, as the real manager converges per engine), generation refused while
    released (SGLang cannot serve without its weights / KV cache) and while resumed weights were not synced
    since (SGLang's memory saver discards released weights: ``weights_discarded``, cleared by a
    RecordingBridge sync), and a log of every call."""

    def __init__(self, num_engines: int = 1, tp_size: int = 1):
        self.num_engines, self.tp_size, self.num_restarts = num_engines, tp_size, 0
        self.released: set = set()
        self.weights_discarded = False
        self.log: list = []

    def release_memory_occupation(self, tags=None):
        self.log.append("release")
        self.released = set(tags or ["kv_cache", "weights"])

    def resume_memory_occupation(self, tags=None):
        self.log.append(f"resume:{','.join(sorted(tags or ['kv_cache', 'weights']))}")
        if "weights" in self.released and "weights" in (tags or ["weights"]):
            self.weights_discarded = True
        self.released -= set(tags or ["kv_cache", "weights"])

    def generate(self, prompts, sampling):
        from rlhf.rollout.types import RolloutSample

        self.log.append("generate")
        if self.released:
            raise RuntimeError(f"generate on engines that released {sorted(self.released)}")
        if self.weights_discarded:
            from rlhf.rollout.manager import WeightsDiscardedError

            raise WeightsDiscardedError(list(range(self.num_engines)))
        return [RolloutSample(list(p), [5, 6], [-0.5, -0.5], "stop", i, j)
                for i, p in enumerate(prompts) for j in range(sampling.n)]

    def stale_engines(self):
        return []

    def shutdown(self):
        self.log.append("shutdown")


class RecordingBridge:
    """WeightBridge stand-in: records each sync and refuses one into released weights (SGLang would load into
    memory the memory saver then discards)."""

    def __init__(self, manager):
        self.manager, self.syncs = manager, []

    def sync(self, engines=None):
        if self.manager is not None:
            assert "weights" not in self.manager.released, "weights synced into released engine memory"
            self.manager.log.append("sync")
            self.manager.weights_discarded = False
        self.syncs.append(engines)
        from rlhf.weight_bridge import SyncStats

        return SyncStats()

    def close(self):
        if self.manager is not None:
            self.manager.log.append("bridge close")
