"""rollout.weight_update_address: the address engines dial for the disaggregated weight-update group
(it came from gethostbyname(gethostname()), 127.0.1.1 on stock Ubuntu)."""
import socket

import pytest

from rlhf.config import compose_config
from parallel.distributed import interface_address, resolve_address, route_address


def test_default_is_an_address_of_one_of_this_hosts_interfaces_not_the_debian_hostname_alias():
    addr = resolve_address(None)
    assert addr == route_address("10.255.255.255") and addr != "127.0.1.1"
    mine = set()
    for _, name in socket.if_nameindex():
        try:
            mine.add(interface_address(name))
        except ValueError:  # an interface without IPv4
            pass
    assert addr in mine, (addr, mine)


def test_interface_and_literal_forms():
    assert resolve_address("iface:lo") == "127.0.0.1"
    assert resolve_address("10.1.2.3") == "10.1.2.3"
    with pytest.raises(ValueError, match=r"iface:nope0.*no IPv4 address on interface 'nope0'; its interfaces: \[.*'lo'"):
        resolve_address("iface:nope0")


def test_config_key_reaches_the_bridge(monkeypatch):
    cfg = compose_config(["rollout.mode=disaggregated", "rollout.weight_update_address=iface:ib0"], recipe="quickstart")
    assert cfg.rollout.weight_update_address == "iface:ib0"
    seen = {}

    class Bridge:
        def __init__(self, chunks, spec, engines, config):
            seen.update(vars(config))

    import rlhf.weight_bridge as ws
    import rlhf.rollout.sampling as sampling
    import rlhf.workers.rollout as wr

    monkeypatch.setattr(ws, "WeightBridge", Bridge)
    monkeypatch.setattr(wr, "start_rollout", lambda cfg, path: None)
    monkeypatch.setattr(sampling, "stop_token_ids_for", lambda path: [])
    monkeypatch.setattr(wr.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(wr.dist, "barrier", lambda group=None: None)
    monkeypatch.setattr(wr.dist, "new_group", lambda backend=None: None)

    class Bundle:
        chunks, spec = [], None

    wr.RolloutWorker(cfg, "unused", Bundle(), tokenizer=None)
    assert seen["master_address"] == "iface:ib0" and seen["transport"] == "distributed"
