"""NeuronCore placement: every documented `NEURON_RT_VISIBLE_CORES` form, contiguity, the TP degree, and
cutting the visible cores into replica groups (the device plugin's comma lists included)."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.errors import ConfigError
from app.placement import (
    check_group,
    format_cores,
    instance_cores,
    parse_cores,
    replica_devices,
    replica_groups,
)


@pytest.mark.parametrize(
    ("value", "cores"),
    [
        ("0", (0,)),  # one index
        ("0-2", (0, 1, 2)),  # an inclusive range
        ("3,4,5,6", (3, 4, 5, 6)),  # a comma list (the Kubernetes device plugin's form)
        ("3-5,6", (3, 4, 5, 6)),  # a mix
        ("0-1, 4-5", (0, 1, 4, 5)),
        ("7-7", (7,)),
    ],
)
def test_every_documented_form_parses(value: str, cores: tuple[int, ...]) -> None:
    assert parse_cores(value) == cores


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("", "not a core index"),
        ("a-b", "not a core index"),
        ("1,,2", "not a core index"),
        ("-1", "not a core index"),
        ("3-1", "ends before it starts"),
        ("4,3", "must increase"),
        ("0-3,2", "must increase"),
    ],
)
def test_malformed_values_are_refused(value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_cores(value)


def test_a_group_must_be_contiguous_and_match_the_tp_degree() -> None:
    check_group((2, 3), 2, "x")
    with pytest.raises(ConfigError, match="not contiguous"):
        check_group(parse_cores("3,5,6"), 3, "x")
    with pytest.raises(ConfigError, match="names 4 NeuronCores but the artifact is compiled for tp_degree 2"):
        check_group(parse_cores("0-3"), 2, "x")


def test_groups_are_passed_on_in_range_form() -> None:
    assert format_cores((4, 5)) == "4-5" and format_cores((6,)) == "6"
    assert format_cores((1, 3)) == "1,3"


def test_replica_groups_cut_the_visible_cores_in_order() -> None:
    assert replica_groups(parse_cores("0-23"), 8, None) == [
        tuple(range(0, 8)),
        tuple(range(8, 16)),
        tuple(range(16, 24)),
    ]
    assert replica_groups(parse_cores("0-11"), 2, 2) == [(0, 1), (2, 3)]
    # the device plugin without the scheduler extension: contiguous pairs, not one contiguous range
    assert replica_groups(parse_cores("0,1,4,5"), 2, None) == [(0, 1), (4, 5)]


def test_replica_groups_refuse_what_does_not_fit() -> None:
    with pytest.raises(ConfigError, match="need 6 NeuronCores but 4 are visible"):
        replica_groups(parse_cores("0-3"), 2, 3)
    with pytest.raises(ConfigError, match="not contiguous"):
        replica_groups(parse_cores("0,2,3,4"), 2, 2)
    with pytest.raises(ConfigError, match="need 8 NeuronCores but 2 are visible"):
        replica_groups(parse_cores("0-1"), 8, None)


def test_replica_devices_follow_the_device_setting_then_the_visible_cores() -> None:
    assert replica_devices("neuron:0-7", "2", 4, None) == ["neuron:0-3", "neuron:4-7"]
    assert replica_devices("neuron", "auto", 2, "2,3,4,5") == ["neuron:2-3", "neuron:4-5"]  # device plugin
    assert replica_devices("neuron", "1", 2, None) == ["neuron"]  # the runtime picks (NEURON_RT_NUM_CORES)
    assert replica_devices("cpu", "3", 1, None) == ["cpu", "cpu", "cpu"]
    assert replica_devices("cuda", "auto", 1, None) == ["cuda"]
    with pytest.raises(ConfigError, match="need 6 NeuronCores but 4 are visible"):
        replica_devices("neuron", "3", 2, "0-3")


def test_instance_cores_counts_two_per_neuron_device(tmp_path: Path) -> None:
    for name in ("neuron0", "neuron1", "neuron2", "null"):
        (tmp_path / name).touch()
    assert instance_cores(tmp_path) == tuple(range(6))
