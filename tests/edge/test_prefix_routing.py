"""The edge's cache-aware replica order (runners/edge/prefix.py): affinity, the load bound, forget, eviction."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runners.edge.prefix import PrefixRouter, ReplicaLoad

pytestmark = pytest.mark.unit

SYSTEM_A = "You are the GPU portal's assistant. Answer briefly and name the flavor you mean. " * 3  # 243 chars
SYSTEM_B = "You are a terse reviewer of training scripts; point at the line, never rewrite it. " * 3


def loads(**tokens: int) -> list[ReplicaLoad]:
    return [ReplicaLoad(key, value) for key, value in tokens.items()]


def test_a_prompt_goes_where_its_prefix_was_sent_not_to_the_least_loaded():
    router = PrefixRouter(block_chars=16, load_slack=1000)
    router.record("r2", SYSTEM_A + "How big is my quota?")
    assert router.order(SYSTEM_A + "Which job ran longest?", loads(r1=0, r2=300, r3=100)) == ["r2", "r1", "r3"]
    # Another system prompt shares nothing with it: least outstanding tokens, as the router does today.
    assert router.order(SYSTEM_B + "Which job ran longest?", loads(r1=0, r2=300, r3=100)) == ["r1", "r3", "r2"]


def test_the_longest_shared_prefix_wins_and_equal_matches_go_to_the_less_loaded():
    router = PrefixRouter(block_chars=16, load_slack=1000)
    router.record("short", SYSTEM_A[:64])
    router.record("long", SYSTEM_A + "first question")
    router.record("also-long", SYSTEM_A + "second question")
    order = router.order(SYSTEM_A + "third", loads(short=0, long=200, **{"also-long": 100}, idle=0))
    assert order == ["also-long", "long", "short", "idle"]


def test_only_whole_blocks_count_as_a_shared_prefix():
    router = PrefixRouter(block_chars=64, load_slack=1000)
    router.record("r1", "x" * 63)  # shorter than a block: nothing the replica's cache could hold
    assert router.held("r1") == 0
    assert router.order("x" * 200, loads(r0=0, r1=10)) == ["r0", "r1"]
    router.record("r1", "x" * 64 + "tail")
    assert router.held("r1") == 1
    assert router.order("x" * 200, loads(r0=0, r1=10))[0] == "r1"
    # The blocks are cut from the start: a prompt that shares a block only further in shares nothing.
    assert router.order("y" + "x" * 200, loads(r0=0, r1=10))[0] == "r0"


def test_a_hot_prefix_spills_to_another_replica_when_its_holder_is_overloaded_beyond_the_slack():
    router = PrefixRouter(block_chars=16, load_slack=500)
    prompt = SYSTEM_A + "question"
    router.record("holder", prompt)
    # Within the slack (exactly at it, too) the holder keeps it.
    assert router.order(prompt, loads(holder=600, other=100, third=300))[0] == "holder"
    # Beyond it: least outstanding tokens, the holder last as the busiest.
    assert router.order(prompt, loads(holder=601, other=100, third=300)) == ["other", "third", "holder"]
    # The replica it spilled to holds it from then on, and both share the prefix's load.
    router.record("other", prompt)
    assert router.order(prompt, loads(holder=601, other=100, third=0)) == ["other", "third", "holder"]
    assert router.order(prompt, loads(holder=200, other=400, third=0)) == ["holder", "other", "third"]


def test_a_forgotten_replica_is_no_longer_preferred_and_its_prefixes_are_dropped():
    router = PrefixRouter(block_chars=16, load_slack=1000)
    router.record("gone", SYSTEM_A)
    router.record("stays", SYSTEM_B)
    assert router.order(SYSTEM_A, loads(gone=50, stays=0))[0] == "gone"
    router.forget("gone")
    assert router.held("gone") == 0
    assert router.size() == router.held("stays") == len(SYSTEM_B) // 16
    assert router.order(SYSTEM_A, loads(gone=50, stays=0)) == ["stays", "gone"]
    router.forget("never-seen")  # nothing to drop
    assert router.order(SYSTEM_B, loads(gone=0, stays=50))[0] == "stays"


def test_memory_is_bounded_per_replica_and_the_oldest_prefixes_go_first():
    router = PrefixRouter(block_chars=8, max_prefixes_per_replica=10, load_slack=1000)
    router.record("r", "a" * 8 * 6)  # six prefixes
    router.record("r", "b" * 8 * 6)  # six more: two of the a's go, the oldest (the longest) first
    assert router.held("r") == 10
    assert router.order("a" * 8 * 6, loads(r=100, idle=0))[0] == "r"  # its two shortest blocks are still held
    for i in range(200):
        router.record("r", f"{i:08d}" * 5)
    assert router.held("r") == 10
    assert router.size() == 10
    assert router.order("a" * 8 * 6, loads(r=100, idle=0)) == ["idle", "r"]
    assert router.order("b" * 8 * 6, loads(r=100, idle=0)) == ["idle", "r"]
    # The newest prompt's five prefixes are all still held: it goes to "r".
    assert router.order(f"{199:08d}" * 5, loads(r=100, idle=0))[0] == "r"


def test_a_prefix_used_again_is_kept_over_older_ones():
    router = PrefixRouter(block_chars=8, max_prefixes_per_replica=4, load_slack=1000)
    router.record("r", "system!!" + "one.....")
    router.record("r", "other!!!" + "two.....")
    router.record("r", "system!!" + "three...")  # touches the shared first block again; evicts "one"
    router.record("r", "fourth!!" + "fifth...")  # evicts the other's two blocks, not the shared one
    assert router.order("system!!" + "anything", loads(r=100, idle=0))[0] == "r"
    assert router.order("other!!!" + "two.....", loads(r=100, idle=0))[0] == "idle"


def test_keys_given_twice_are_ranked_once_and_no_replicas_gives_nothing():
    router = PrefixRouter(block_chars=16)
    assert router.order(SYSTEM_A, []) == []
    assert router.order(SYSTEM_A, [ReplicaLoad("a", 5), ReplicaLoad("a", 0), ReplicaLoad("b", 1)]) == ["b", "a"]


@pytest.mark.parametrize("kwargs", [
    {"block_chars": 0}, {"block_chars": 1.5}, {"block_chars": True}, {"max_prefixes_per_replica": 0},
    {"load_slack": -1}, {"load_slack": float("nan")}, {"load_slack": "10"},
])
def test_bad_settings_are_refused_naming_them(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        PrefixRouter(**kwargs)


def test_threads_recording_and_ordering_at_once_keep_the_bound():
    router = PrefixRouter(block_chars=4, max_prefixes_per_replica=50, load_slack=0)
    errors = []

    def work(n: int) -> None:
        try:
            for i in range(300):
                key = f"r{(n + i) % 3}"
                router.record(key, f"{n:04d}{i:04d}" * 3)
                order = router.order(f"{n:04d}{i:04d}", loads(r0=i, r1=n, r2=0))
                assert sorted(order) == ["r0", "r1", "r2"]
                if i % 97 == 0:
                    router.forget(key)
        except Exception as error:  # noqa: BLE001 - the assertion below reports it
            errors.append(error)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert all(router.held(f"r{k}") <= 50 for k in range(3))
    assert router.size() <= 150


# --- properties -------------------------------------------------------------------------------------

keys = st.text(alphabet="abcdef", min_size=1, max_size=3)
prompts = st.text(alphabet="ab c", max_size=40)
replica_lists = st.lists(st.builds(ReplicaLoad, keys, st.integers(0, 10_000)), max_size=8)


@settings(max_examples=300, deadline=None)
@given(
    recorded=st.lists(st.tuples(keys, prompts), max_size=20),
    forgotten=st.lists(keys, max_size=3),
    prompt=prompts,
    replicas=replica_lists,
    block=st.integers(1, 6),
    capacity=st.integers(1, 12),
    slack=st.floats(0, 20_000),
)
def test_the_order_is_always_a_permutation_of_the_replicas_given(recorded, forgotten, prompt, replicas, block,
                                                                   capacity, slack):
    router = PrefixRouter(block_chars=block, max_prefixes_per_replica=capacity, load_slack=slack)
    for key, text in recorded:
        router.record(key, text)
    for key in forgotten:
        router.forget(key)
    order = router.order(prompt, replicas)
    assert sorted(order) == sorted({replica.key for replica in replicas})
    assert all(router.held(key) <= capacity for key, _ in recorded)


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    keys_given=st.lists(keys, min_size=1, max_size=6, unique=True),
    load=st.integers(0, 10_000),
    block=st.integers(1, 5),
)
def test_with_equal_loads_the_longest_prefix_holder_is_first(data, keys_given, load, block):
    router = PrefixRouter(block_chars=block, load_slack=0)
    # Each replica was sent some prefix of one prompt (a different length each): the one sent the
    # longest holds the most of it.
    prompt = data.draw(st.text(alphabet="xyz", min_size=block * (len(keys_given) + 1), max_size=60))
    cuts = data.draw(st.lists(st.integers(0, len(prompt) // block), min_size=len(keys_given),
                              max_size=len(keys_given), unique=True))
    for key, blocks in zip(keys_given, cuts):
        router.record(key, prompt[: blocks * block])
    longest = keys_given[cuts.index(max(cuts))]
    order = router.order(prompt, [ReplicaLoad(key, load) for key in keys_given])
    if max(cuts) > 0:
        assert order[0] == longest
    else:
        assert order == sorted(keys_given)  # nobody holds a whole block: by load, then key
