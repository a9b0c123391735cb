"""The link-attribution rule of ``benchmarks/multinode.py`` ([Note: link attribution] in benchmarks/links.py)."""

import pytest

from benchmarks.links import crossing_hops, link_bytes, zp_groups


def test_crossing_hops_of_rings_on_two_nodes_of_two():
    assert crossing_hops((0, 1, 2, 3), 2) == 2  # 0-1 | 1-2 x | 2-3 | 3-0 x
    assert crossing_hops((0, 1), 2) == 0
    assert crossing_hops((2, 3), 2) == 0
    assert crossing_hops((0, 2), 2) == 2  # both hops of a two-rank ring
    assert crossing_hops((1, 3), 2) == 2
    assert crossing_hops((3,), 2) == 0
    assert crossing_hops((0, 1, 2, 3), 4) == 0  # one node
    assert crossing_hops((0, 1, 2, 3), 1) == 4  # every rank its own node


def test_world_collective_crosses_on_half_its_wire_bytes():
    out = link_bytes({(0, 1, 2, 3): 400.0}, node_size=2)
    assert out == {"logical": 400.0, "wire": 300.0, "intra": 150.0, "inter": 150.0, "spanning": 400.0}


def test_groups_inside_and_across_nodes():
    out = link_bytes({(0, 1): 100.0, (0, 2): 60.0, (0,): 5.0}, node_size=2)
    assert out["logical"] == 165.0
    assert out["intra"] == 50.0  # shard group: half its logical volume on the wire, none crossing
    assert out["inter"] == 30.0  # replica group: every hop crosses
    assert out["wire"] == 80.0  # a one-rank group sends nothing
    assert out["spanning"] == 60.0


def test_link_bytes_rejects_a_bad_node_size():
    with pytest.raises(ValueError, match="node_size"):
        link_bytes({(0, 1): 1.0}, node_size=0)


@pytest.mark.parametrize(
    ("rank", "shard", "replica"), [(0, (0, 1), (0, 2)), (1, (0, 1), (1, 3)), (2, (2, 3), (0, 2)), (3, (2, 3), (1, 3))]
)
def test_zp_groups_maps_labels_to_ranks(rank, shard, replica):
    stats = {"total": 100, "shard_group": 70, "replica_group": 20}
    assert zp_groups(stats, rank, 4, 2) == {shard: 70.0, replica: 20.0, (0, 1, 2, 3): 10.0}


def test_zp_groups_without_a_split_is_all_world():
    assert zp_groups({"total": 42, "all_gather": 42}, 1, 4, None) == {(0, 1, 2, 3): 42.0}
    assert zp_groups({"total": 42}, 1, 4, 4) == {(0, 1, 2, 3): 42.0}


def test_zp_groups_secondary_group_is_the_node():
    stats = {"total": 100, "secondary_group": 30}
    assert zp_groups(stats, 3, 4, None, 2) == {(2, 3): 30.0, (0, 1, 2, 3): 70.0}
