"""FlowNetwork: fair sharing of link capacity between concurrent flows.

Oracles are closed forms of processor sharing on one link: a flow of S bytes
alone on a link of capacity C takes S/C; k equal flows started together each take
k·S/C; rates are recomputed when a flow starts or ends; a flow of weight w on a
shared link loads it like w flows.
"""

from __future__ import annotations

import pytest
import simpy

from simulator.system.network import FlowNetwork

C = 1e9  # bytes/s
S = 4e8  # bytes
REL = 1e-12


def _net(capacity: dict | float = C, shared: bool = False) -> tuple[simpy.Environment, FlowNetwork]:
    env = simpy.Environment()
    if isinstance(capacity, dict):
        caps = capacity
        net = FlowNetwork(env, lambda link: caps[link], lambda link: shared)
    else:
        net = FlowNetwork(env, lambda link: capacity, lambda link: shared)
    return env, net


def _start(env: simpy.Environment, net: FlowNetwork, at: float, nbytes: float,
           links: tuple, weight: float = 1.0) -> dict[str, float]:
    """Start a flow at time ``at``; the returned dict gets its finish time."""
    out: dict[str, float] = {}

    def proc():
        if at > 0:
            yield env.timeout(at)
        yield net.transfer(nbytes, links, weight)
        out["end"] = env.now

    env.process(proc())
    return out


def test_single_flow_takes_size_over_capacity():
    env, net = _net()
    f = _start(env, net, 0.0, S, (("nvl", 0),))
    env.run()
    assert f["end"] == pytest.approx(S / C, rel=REL)


@pytest.mark.parametrize("k", [2, 3, 5])
def test_equal_flows_started_together_share_fairly(k):
    env, net = _net()
    flows = [_start(env, net, 0.0, S, (("nvl", 0),)) for _ in range(k)]
    env.run()
    for f in flows:
        assert f["end"] == pytest.approx(k * S / C, rel=REL)


def test_two_flows_on_one_link_each_take_twice_as_long():
    env, net = _net()
    a = _start(env, net, 0.0, S, (("nic", 3),))
    b = _start(env, net, 0.0, S, (("nic", 3),))
    env.run()
    alone = S / C
    assert a["end"] == pytest.approx(2 * alone, rel=REL)
    assert b["end"] == pytest.approx(2 * alone, rel=REL)


def test_flows_on_different_links_do_not_interact():
    env, net = _net()
    a = _start(env, net, 0.0, S, (("nvl", 0),))
    b = _start(env, net, 0.0, S, (("nvl", 1),))
    env.run()
    assert a["end"] == pytest.approx(S / C, rel=REL)
    assert b["end"] == pytest.approx(S / C, rel=REL)


@pytest.mark.parametrize("t1_frac", [0.1, 0.5, 0.9])
def test_flow_joining_midway_rates_recomputed(t1_frac):
    """A (S bytes) starts at 0, B (S bytes) joins at t1 < S/C.

    At t1 A has S - C·t1 left; both then run at C/2, so A ends at
    t1 + 2(S - C·t1)/C; B then has C·t1 left at full rate and ends at 2S/C.
    """
    t1 = t1_frac * S / C
    env, net = _net()
    a = _start(env, net, 0.0, S, (("nvl", 0),))
    b = _start(env, net, t1, S, (("nvl", 0),))
    env.run()
    assert a["end"] == pytest.approx(t1 + 2 * (S - C * t1) / C, rel=REL)
    assert b["end"] == pytest.approx(2 * S / C, rel=REL)


def test_unequal_flows_short_one_leaves_and_long_one_speeds_up():
    """Sizes S and 3S together: the short one ends at 2S/C, the long at 4S/C."""
    env, net = _net()
    short = _start(env, net, 0.0, S, (("nvl", 0),))
    long = _start(env, net, 0.0, 3 * S, (("nvl", 0),))
    env.run()
    assert short["end"] == pytest.approx(2 * S / C, rel=REL)
    assert long["end"] == pytest.approx(4 * S / C, rel=REL)


def test_three_flows_staggered_closed_form():
    """Flows of S at t=0, S at t=a, S at t=b (processor sharing, equal sizes).

    With a = 0.2 S/C, b = 0.4 S/C (all three overlap):
    0..a: A alone, A has done 0.2 S.
    a..b: A, B at C/2: A 0.3 S done, B 0.1 S done.
    from b: three flows at C/3; A (0.7 S left) ends first at b + 2.1 S/C;
    then B (left 0.9 S - 0.7 S = 0.2 S) and C (0.3 S) at C/2: B ends 0.4 S/C later;
    then C has 0.1 S at C: ends 0.1 S/C later.
    """
    u = S / C
    a_t, b_t = 0.2 * u, 0.4 * u
    env, net = _net()
    fa = _start(env, net, 0.0, S, (("nvl", 0),))
    fb = _start(env, net, a_t, S, (("nvl", 0),))
    fc = _start(env, net, b_t, S, (("nvl", 0),))
    env.run()
    end_a = b_t + 2.1 * u
    end_b = end_a + 0.4 * u
    end_c = end_b + 0.1 * u
    assert fa["end"] == pytest.approx(end_a, rel=1e-9)
    assert fb["end"] == pytest.approx(end_b, rel=1e-9)
    assert fc["end"] == pytest.approx(end_c, rel=1e-9)
    assert end_c == pytest.approx(3 * u, rel=1e-12)  # work conservation


@pytest.mark.parametrize("w", [1.0, 2.0, 4.0, 7.0])
def test_weight_on_shared_link_behaves_like_w_flows(w):
    """A weight-w flow plus one plain flow on a shared link: both run at C/(w+1),
    exactly as if w+1 equal flows shared it."""
    env, net = _net(shared=True)
    heavy = _start(env, net, 0.0, S, (("core",),), weight=w)
    light = _start(env, net, 0.0, S, (("core",),), weight=1.0)
    env.run()
    assert heavy["end"] == pytest.approx((w + 1) * S / C, rel=REL)
    assert light["end"] == pytest.approx((w + 1) * S / C, rel=REL)

    # the same with w + 1 explicit equal flows
    env2, net2 = _net(shared=True)
    many = [_start(env2, net2, 0.0, S, (("core",),)) for _ in range(int(w) + 1)]
    env2.run()
    for f in many:
        assert f["end"] == pytest.approx(heavy["end"], rel=REL)


def test_weight_alone_on_shared_link():
    env, net = _net(shared=True)
    f = _start(env, net, 0.0, S, (("core",),), weight=3.0)
    env.run()
    assert f["end"] == pytest.approx(3 * S / C, rel=REL)


def test_weight_ignored_on_private_links():
    env, net = _net(shared=False)
    f = _start(env, net, 0.0, S, (("nic", 0),), weight=8.0)
    env.run()
    assert f["end"] == pytest.approx(S / C, rel=REL)


def test_multi_link_flow_bottleneck_is_smallest_fair_share():
    """A flow over (nic, core) runs at min(C_nic / 1, C_core / weight)."""
    caps = {("nic", 0): 2 * C, ("core",): 3 * C}
    env = simpy.Environment()
    net = FlowNetwork(env, lambda link: caps[link], lambda link: link[0] == "core")
    f = _start(env, net, 0.0, S, (("nic", 0), ("core",)), weight=6.0)  # core share C/2
    env.run()
    assert f["end"] == pytest.approx(S / (0.5 * C), rel=REL)


def test_zero_bytes_completes_immediately():
    env, net = _net()
    f = _start(env, net, 0.0, 0.0, (("nvl", 0),))
    env.run()
    assert f["end"] == 0.0


def test_link_busy_time_accounts_union_of_flows():
    u = S / C
    env, net = _net()
    _start(env, net, 0.0, S, (("nvl", 0),))
    _start(env, net, 0.5 * u, S, (("nvl", 0),))
    _start(env, net, 10 * u, S, (("nvl", 0),))
    env.run()
    # first two overlap and are busy until 2u of work is done: [0, 2u]; third [10u, 11u]
    assert net.busy[("nvl", 0)] == pytest.approx(3 * u, rel=1e-9)
    assert net.flows_started == 3
