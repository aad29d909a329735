"""MIG geometry: the validator agrees with NVIDIA's placement table on every multiset of profiles."""

import re
from collections import Counter
from functools import lru_cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runners.nvidia.mig import (
    GPU_MODELS,
    LayoutError,
    MigNotSupportedError,
    UnknownGpuModelError,
    fit_layout,
    free_starts,
    profiles_for,
    valid_placement,
)

pytestmark = pytest.mark.unit

# NVIDIA's tables, written out here independently of the module under test.
# `nvidia-smi mig -lgipp` on A100/H100 (MIG User Guide), one line per profile ID:
#   19 {0,1,2,3,4,5,6}:1   20 {0,1,2,3,4,5,6}:1   15 {0,2,4,6}:2   14 {0,2,4}:2
#    9 {0,4}:4              5 {0}:4                0 {0}:8
# "Number of Instances Available" and the SM fraction from "Supported MIG Profiles".
# Each row: profile name -> (starts, span, compute slices, max instances).
RAW_TABLES = {
    "H100-80GB": {
        "1g.10gb": ({0, 1, 2, 3, 4, 5, 6}, 1, 1, 7),
        "1g.10gb+me": ({0, 1, 2, 3, 4, 5, 6}, 1, 1, 1),
        "1g.20gb": ({0, 2, 4, 6}, 2, 1, 4),
        "2g.20gb": ({0, 2, 4}, 2, 2, 3),
        "3g.40gb": ({0, 4}, 4, 3, 2),
        "4g.40gb": ({0}, 4, 4, 1),
        "7g.80gb": ({0}, 8, 7, 1),
    },
    "A100-40GB": {
        "1g.5gb": ({0, 1, 2, 3, 4, 5, 6}, 1, 1, 7),
        "1g.5gb+me": ({0, 1, 2, 3, 4, 5, 6}, 1, 1, 1),
        "1g.10gb": ({0, 2, 4, 6}, 2, 1, 4),
        "2g.10gb": ({0, 2, 4}, 2, 2, 3),
        "3g.20gb": ({0, 4}, 4, 3, 2),
        "4g.20gb": ({0}, 4, 4, 1),
        "7g.40gb": ({0}, 8, 7, 1),
    },
    "H200-141GB": {
        "1g.18gb": ({0, 1, 2, 3, 4, 5, 6}, 1, 1, 7),
        "1g.18gb+me": ({0, 1, 2, 3, 4, 5, 6}, 1, 1, 1),
        "1g.35gb": ({0, 2, 4, 6}, 2, 1, 4),
        "2g.35gb": ({0, 2, 4}, 2, 2, 3),
        "3g.71gb": ({0, 4}, 4, 3, 2),
        "4g.71gb": ({0}, 4, 4, 1),
        "7g.141gb": ({0}, 8, 7, 1),
    },
    "A100-80GB": {
        "1g.10gb": ({0, 1, 2, 3, 4, 5, 6}, 1, 1, 7),
        "1g.10gb+me": ({0, 1, 2, 3, 4, 5, 6}, 1, 1, 1),
        "1g.20gb": ({0, 2, 4, 6}, 2, 1, 4),
        "2g.20gb": ({0, 2, 4}, 2, 2, 3),
        "3g.40gb": ({0, 4}, 4, 3, 2),
        "4g.40gb": ({0}, 4, 4, 1),
        "7g.80gb": ({0}, 8, 7, 1),
    },
}
MODELS = list(RAW_TABLES)


def oracle_valid(model: str, placed) -> bool:
    """A placement is valid: allowed starts, no shared memory slot, <= 7 compute, <= 1 +me, counts <= max."""
    table = RAW_TABLES[model]
    counts = Counter(name for name, _ in placed)
    if any(name not in table or count > table[name][3] for name, count in counts.items()):
        return False
    if sum(count for name, count in counts.items() if name.endswith("+me")) > 1:
        return False
    if sum(table[name][2] for name, _ in placed) > 7:
        return False
    used = set()
    for name, start in placed:
        starts, span, _, _ = table[name]
        slots = set(range(start, start + span))
        if start not in starts or slots & used:
            return False
        used |= slots
    return True


@lru_cache(maxsize=None)
def oracle_fits(model: str, multiset: tuple[str, ...]) -> bool:
    """Brute force: some choice of starts for the (sorted) multiset is a valid placement."""
    table = RAW_TABLES[model]
    # Counts, compute and +me do not depend on the starts: check them once, with any starts.
    if not oracle_valid_ignoring_slots(model, multiset):
        return False

    def search(index: int, placed: list, used: frozenset) -> bool:
        if index == len(multiset):
            return oracle_valid(model, placed)
        name = multiset[index]
        starts, span, _, _ = table[name]
        # Identical instances are interchangeable; trying them in increasing order is enough.
        lowest = placed[-1][1] + 1 if placed and placed[-1][0] == name else 0
        for start in sorted(starts):
            slots = frozenset(range(start, start + span))
            if start >= lowest and not slots & used and search(index + 1, [*placed, (name, start)], used | slots):
                return True
        return False

    return search(0, [], frozenset())


def oracle_valid_ignoring_slots(model: str, multiset: tuple[str, ...]) -> bool:
    """The start-independent rules: known names, counts <= max, <= 1 +me, <= 7 compute slices."""
    table = RAW_TABLES[model]
    counts = Counter(multiset)
    return (
        all(name in table and count <= table[name][3] for name, count in counts.items())
        and sum(count for name, count in counts.items() if name.endswith("+me")) <= 1
        and sum(table[name][2] for name in multiset) <= 7
    )


def every_multiset_up_to_full(model: str):
    """Every multiset that fits, plus each one-profile extension of it (the first that no longer fit)."""
    names = sorted(RAW_TABLES[model])
    seen = set()
    frontier = [()]
    while frontier:
        grown = []
        for multiset in frontier:
            if multiset in seen:
                continue
            seen.add(multiset)
            yield multiset
            # A multiset that does not fit has no superset that fits, so stop growing it there.
            if oracle_fits(model, multiset):
                grown.extend(tuple(sorted((*multiset, name))) for name in names)
        frontier = grown


@pytest.mark.parametrize("model", MODELS)
def test_the_tables_match_nvidias_published_placements(model):
    profiles = profiles_for(model)
    assert sorted(profiles) == sorted(RAW_TABLES[model])
    for name, (starts, span, compute_slices, max_instances) in RAW_TABLES[model].items():
        profile = profiles[name]
        assert set(profile.starts) == starts, name
        assert profile.span == span, name
        assert profile.memory_slices == span, name
        assert profile.compute_slices == compute_slices, name
        assert profile.max_instances == max_instances, name


@pytest.mark.parametrize("model", MODELS)
def test_the_validator_agrees_with_brute_force_on_every_multiset(model):
    checked = fitting = 0
    for multiset in every_multiset_up_to_full(model):
        checked += 1
        expected = oracle_fits(model, multiset)
        try:
            placement = fit_layout(model, list(multiset))
        except LayoutError as error:
            assert not expected, f"{multiset} fits by brute force but fit_layout said: {error}"
            continue
        assert expected, f"fit_layout placed {multiset} as {placement}, which brute force rejects"
        fitting += 1
        assert sorted(name for name, _ in placement) == list(multiset)
        assert oracle_valid(model, placement), placement
        assert valid_placement(model, placement)
        for name in RAW_TABLES[model]:
            starts = sorted(RAW_TABLES[model][name][0])
            expected_starts = [start for start in starts if oracle_valid(model, [*placement, (name, start)])]
            assert free_starts(model, placement, name) == expected_starts, (placement, name)
    # Sanity of the enumeration itself: it reached full GPUs and past them.
    assert fitting > 100 and checked > fitting


@settings(max_examples=300, deadline=None)
@given(
    model=st.sampled_from(MODELS),
    data=st.data(),
)
def test_valid_placement_agrees_with_brute_force_on_random_placements(model, data):
    names = sorted(RAW_TABLES[model])
    placed = data.draw(
        st.lists(st.tuples(st.sampled_from(names), st.integers(min_value=0, max_value=7)), max_size=8)
    )
    assert valid_placement(model, placed) == oracle_valid(model, placed)


@pytest.mark.parametrize(
    ("model", "layout"),
    [
        ("H100-80GB", ["4g.40gb", "3g.40gb"]),
        ("H100-80GB", ["1g.10gb"] * 7),
        ("H100-80GB", ["7g.80gb"]),
        ("H100-80GB", ["3g.40gb", "3g.40gb"]),
        ("H100-80GB", ["1g.10gb+me", "1g.10gb", "1g.10gb", "1g.10gb", "1g.10gb", "1g.10gb", "1g.10gb"]),
        ("H100-80GB", ["1g.20gb"] * 4),
        ("A100-40GB", ["3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb"]),
        ("A100-40GB", ["4g.20gb", "2g.10gb", "1g.5gb"]),
        ("H200-141GB", ["4g.71gb", "3g.71gb"]),
        ("H200-141GB", ["2g.35gb", "2g.35gb", "2g.35gb", "1g.35gb"]),
    ],
)
def test_it_fits_layouts_nvidia_documents(model, layout):
    placement = fit_layout(model, layout)
    assert sorted(name for name, _ in placement) == sorted(layout)
    assert valid_placement(model, placement)


def test_it_places_the_3_2_1_1_geometry_with_the_3g_on_the_upper_half():
    # The MIG User Guide's example 2: a 3g at 0 would leave the second 1g only slot 7.
    assert fit_layout("A100-40GB", ["1g.5gb", "1g.5gb", "2g.10gb", "3g.20gb"]) == [
        ("2g.10gb", 0), ("1g.5gb", 2), ("1g.5gb", 3), ("3g.20gb", 4),
    ]


@pytest.mark.parametrize(
    ("layout", "reason"),
    [
        (["4g.40gb", "4g.40gb"], "too many instances of 4g.40gb"),
        (["3g.40gb"] * 3, "too many instances of 3g.40gb"),
        (["1g.10gb"] * 8, "too many instances of 1g.10gb"),
        (["1g.10gb+me", "1g.10gb+me"], "more than one +me"),
        (["7g.80gb", "1g.10gb"], "compute slices exhausted"),
        (["3g.40gb", "3g.40gb", "1g.10gb"], "memory slices exhausted"),
        (["1g.80gb"], "unknown MIG profile '1g.80gb'"),
    ],
)
def test_it_rejects_impossible_layouts_naming_the_problem(layout, reason):
    with pytest.raises(LayoutError, match=re.escape(reason)):
        fit_layout("H100-80GB", layout)


def test_the_7g_profile_fits_alone_and_leaves_no_room_for_anything():
    assert fit_layout("H100-80GB", ["7g.80gb"]) == [("7g.80gb", 0)]
    for name in RAW_TABLES["H100-80GB"]:
        assert free_starts("H100-80GB", [("7g.80gb", 0)], name) == []
        with pytest.raises(LayoutError):
            fit_layout("H100-80GB", ["7g.80gb", name])


def test_a_1g_may_start_at_slot_6_but_never_at_slot_7():
    assert valid_placement("H100-80GB", [("1g.10gb", 6)])
    assert not valid_placement("H100-80GB", [("1g.10gb", 7)])
    assert valid_placement("H100-80GB", [("1g.20gb", 6)])


def test_free_starts_lists_the_slots_left_beside_a_3g():
    assert free_starts("H100-80GB", [("3g.40gb", 0)], "1g.20gb") == [4, 6]
    assert free_starts("H100-80GB", [("3g.40gb", 0)], "3g.40gb") == [4]
    assert free_starts("H100-80GB", [("3g.40gb", 0)], "4g.40gb") == []


def test_free_starts_rejects_an_invalid_existing_placement():
    with pytest.raises(LayoutError, match="overlaps"):
        free_starts("H100-80GB", [("4g.40gb", 0), ("3g.40gb", 0)], "1g.10gb")


def test_it_rejects_an_unknown_model_by_name():
    with pytest.raises(UnknownGpuModelError, match="unknown GPU model 'V100'") as raised:
        fit_layout("V100", ["1g.10gb"])
    assert isinstance(raised.value, KeyError) and isinstance(raised.value, ValueError)


def test_it_rejects_mig_layouts_on_a_gpu_without_mig():
    with pytest.raises(MigNotSupportedError, match="'T4' does not support MIG"):
        profiles_for("T4")
    with pytest.raises(ValueError, match="'L4' does not support MIG"):
        fit_layout("L4", ["1g.10gb"])


def test_every_required_model_is_in_the_catalog():
    assert {"A100-40GB", "A100-80GB", "H100-80GB", "H200-141GB", "L4", "T4", "A10"} <= set(GPU_MODELS)
    assert GPU_MODELS["H100-80GB"].product_label == "NVIDIA-H100-80GB-HBM3"
    assert GPU_MODELS["A100-40GB"].product_label == "NVIDIA-A100-SXM4-40GB"
    assert not GPU_MODELS["T4"].mig_capable and GPU_MODELS["T4"].profiles == {}
    h100 = GPU_MODELS["H100-80GB"]
    assert (h100.compute_slices, h100.memory_slices) == (7, 8)


def test_the_media_extension_profile_is_advertised_with_a_dot():
    profiles = profiles_for("H100-80GB")
    assert profiles["1g.10gb"].kubernetes_resource == "nvidia.com/mig-1g.10gb"
    assert profiles["1g.10gb+me"].kubernetes_resource == "nvidia.com/mig-1g.10gb.me"
