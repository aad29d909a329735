"""The edge's admission for one replica: a limit on its requests in flight, learned from its refusals.

The replica refuses (429) what its queue or the deadlines behind its work cannot take; each such refusal
costs the replica and the edge a whole round trip of CPU on the core they share. So the edge learns from
them: a refusal cuts the replica's limit to nine tenths of what it then held, and each answer gives a little
back. Past the limit the edge refuses by itself, before reading the request's body."""

import pytest

from runners.edge.probes import LIMIT_CUT_EVERY_S, ReplicaState
from runners.edge.table import Target

pytestmark = pytest.mark.unit

CAP = 128


def _state() -> ReplicaState:
    return ReplicaState(Target(key="1", address="http://127.0.0.1:9", health_path="/readyz"))


def test_until_a_refusal_the_cap_is_the_limit():
    state = _state()
    state.in_flight = CAP - 1
    assert state.admits(CAP)
    state.in_flight = CAP
    assert not state.admits(CAP)
    for _ in range(1000):
        state.answered(CAP)
    assert state.limit == CAP, "answers never lift the limit past the endpoint's cap"


def test_a_refusal_cuts_the_limit_below_what_the_replica_held_and_answers_give_it_back_slowly():
    state = _state()
    state.in_flight = 100
    state.refused(now=10.0, cap=CAP)
    assert state.limit == pytest.approx(90.0)
    state.in_flight = 90
    assert not state.admits(CAP), "at the learned limit the edge refuses by itself"
    state.in_flight = 89
    assert state.admits(CAP)
    # One more in flight for about each limit's worth of answers (additive increase).
    for _ in range(90):
        state.answered(CAP)
    assert 90.9 < state.limit < 91.1


def test_a_burst_of_refusals_is_one_cut_and_the_limit_never_falls_under_two():
    state = _state()
    state.in_flight = 50
    for n in range(20):  # twenty refusals of one burst, within LIMIT_CUT_EVERY_S
        state.refused(now=5.0 + n * LIMIT_CUT_EVERY_S / 40, cap=CAP)
    assert state.limit == pytest.approx(45.0)
    state.in_flight = 1  # a deadline too short even for an idle replica: refused with one in flight
    state.refused(now=6.0, cap=CAP)
    assert state.limit == 2.0
    state.in_flight = 1
    assert state.admits(CAP)
