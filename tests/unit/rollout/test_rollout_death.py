"""Which call errors the rollout manager treats as a dead engine (replaced within max_restarts, counted in
rollout/num_restarts) and which it raises.  Bug: an engine whose worker Ray's memory monitor killed raised
OutOfMemoryError straight out of generate and stopped the run instead of being replaced."""
import ray

from rlhf.rollout import manager


def test_ray_oom_kill_of_an_engine_is_an_engine_death():
    assert manager._is_actor_death(ray.exceptions.OutOfMemoryError("worker killed: node low on memory"))
    assert manager._is_actor_death(ray.exceptions.ActorUnavailableError("gone", b"\0" * 16))


def test_errors_of_a_live_engine_are_not_deaths():
    assert not manager._is_actor_death(RuntimeError("bad sampling params"))
    assert not manager._is_actor_death(ray.exceptions.GetTimeoutError("slow"))
