"""Retention keeps exactly what its policy says, over randomized histories of checkpoints and metrics."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runners.storage.retention import RetentionPolicy, StoredCheckpoint, freed, kept, parse_policy

pytestmark = pytest.mark.unit

counts = st.one_of(st.none(), st.integers(min_value=0, max_value=12))
policies = st.builds(RetentionPolicy, keep_newest=counts, keep_best=counts,
                     keep_every=st.one_of(st.none(), st.integers(min_value=1, max_value=8)),
                     smaller_is_better=st.booleans())
metrics = st.one_of(st.none(), st.floats(min_value=-10, max_value=10, allow_nan=False), st.just(math.nan))


@st.composite
def histories(draw):
    steps = draw(st.lists(st.integers(min_value=0, max_value=10_000), unique=True, max_size=40))
    history = [StoredCheckpoint(id=index + 1, step=step, metric=draw(metrics)) for index, step in enumerate(steps)]
    alive = {checkpoint.id for checkpoint in history if draw(st.booleans()) or draw(st.booleans())}
    protected = {checkpoint.id for checkpoint in history if draw(st.integers(0, 9)) == 0}
    return history, alive, protected


def expected(policy, history, alive, protected):
    """The policy's three rules, spelled out one by one from their definitions."""
    by_step = sorted(history, key=lambda checkpoint: checkpoint.step)
    stored = [checkpoint for checkpoint in by_step if checkpoint.id in alive]
    if policy.keep_newest is None and policy.keep_best is None and policy.keep_every is None:
        return {checkpoint.id for checkpoint in stored}
    keep = set(protected) & alive
    newest = sorted(stored, key=lambda checkpoint: checkpoint.step, reverse=True)
    keep |= {checkpoint.id for checkpoint in newest[:policy.keep_newest or 0]}
    if policy.keep_best:
        scored = [c for c in stored if c.metric is not None and not math.isnan(c.metric)]
        for _ in range(min(policy.keep_best, len(scored))):
            best_value = (min if policy.smaller_is_better else max)(c.metric for c in scored)
            winner = max((c for c in scored if c.metric == best_value), key=lambda c: c.step)
            keep.add(winner.id)
            scored.remove(winner)
    if policy.keep_every:
        keep |= {checkpoint.id for ordinal, checkpoint in enumerate(by_step, start=1)
                 if ordinal % policy.keep_every == 0 and checkpoint.id in alive}
    return keep


@settings(max_examples=400, deadline=None)
@given(policies, histories())
def test_a_policy_keeps_exactly_what_it_says(policy, drawn):
    history, alive, protected = drawn
    keep = kept(policy, history, candidates=alive, protected=protected)
    assert keep == expected(policy, history, alive, protected)
    assert keep <= alive
    assert freed(policy, history, candidates=alive, protected=protected) == alive - keep


@settings(max_examples=200, deadline=None)
@given(policies, histories())
def test_applying_a_policy_twice_frees_nothing_more(policy, drawn):
    """The sweep runs again and again: what it keeps once, it keeps (keep_best and keep_newest among the
    survivors are the same ones, keep_every counts over the whole history)."""
    history, alive, protected = drawn
    first = kept(policy, history, candidates=alive, protected=protected)
    assert kept(policy, history, candidates=first, protected=protected) == first


@settings(max_examples=200, deadline=None)
@given(policies, histories())
def test_the_newest_stored_checkpoint_is_kept_when_any_count_rule_is_on(policy, drawn):
    history, alive, _ = drawn
    stored = [checkpoint for checkpoint in history if checkpoint.id in alive]
    if stored and policy.keep_newest:
        newest = max(stored, key=lambda checkpoint: checkpoint.step)
        assert newest.id in kept(policy, history, candidates=alive)


def test_a_policy_with_every_rule_off_keeps_everything():
    history = [StoredCheckpoint(id=i, step=i * 10) for i in range(1, 6)]
    assert kept(RetentionPolicy(), history) == {1, 2, 3, 4, 5}


def test_keep_zero_newest_and_nothing_else_frees_all_but_the_protected():
    history = [StoredCheckpoint(id=i, step=i * 10) for i in range(1, 6)]
    assert freed(RetentionPolicy(keep_newest=0), history, protected={5}) == {1, 2, 3, 4}


def test_a_malformed_policy_is_refused_naming_its_field():
    with pytest.raises(ValueError, match=r"checkpoint_retention\.keep_newest"):
        parse_policy({"keep_newest": -1})
    with pytest.raises(ValueError, match=r"checkpoint_retention\.keep_every"):
        parse_policy({"keep_every": 0})
    with pytest.raises(ValueError, match=r"checkpoint_retention\.keep_last"):
        parse_policy({"keep_last": 3})
    with pytest.raises(ValueError, match=r"checkpoint_retention\.metric"):
        parse_policy({"metric": "accuracy"})
    assert parse_policy({"keep_newest": 2, "keep_every": 5}) == RetentionPolicy(keep_newest=2, keep_every=5)
