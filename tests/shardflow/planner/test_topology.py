import pytest

from shardflow.errors import InputError
from shardflow.planner.topology import load_topology, parse_topology

GOOD = {
    "intra_node_gbytes_per_s": 600,
    "nodes": [
        {"name": "a", "devices": 8, "uplink_gbytes_per_s": 12.5},
        {"name": "b", "devices": 4, "uplink_gbytes_per_s": 3.0},
    ],
}


def test_devices_are_numbered_node_by_node():
    t = parse_topology(GOOD)
    assert t.devices == 12
    assert t.node_of_device.tolist() == [0] * 8 + [1] * 4
    assert t.node_start.tolist() == [0, 8]
    assert t.uplink_bytes_per_s.tolist() == [12.5e9, 3e9]
    assert t.device_memory_bytes is None


def node(**kw):
    return {**GOOD["nodes"][0], **kw}


@pytest.mark.parametrize(
    "data, message",
    [
        ({**GOOD, "nodes": []}, "no nodes"),
        ({**GOOD, "nodes": [node(devices=0)]}, r"node 'a' has devices = 0; accepted: an integer >= 1"),
        ({**GOOD, "nodes": [node(), node()]}, r"node names repeat: \['a'\]"),
        ({**GOOD, "nodes": [node(uplink_gbytes_per_s=-1)]}, r"uplink_gbytes_per_s = -1; accepted: a number > 0"),
        ({**GOOD, "intra_node_gbytes_per_s": 0}, r"intra_node_gbytes_per_s = 0; accepted: a number > 0"),
        ({**GOOD, "device_memory_bytes": -5}, r"device_memory_bytes = -5"),
        ({**GOOD, "gpus": 3}, r"unknown keys \['gpus'\]"),
        ({"nodes": GOOD["nodes"]}, "'intra_node_gbytes_per_s' is missing"),
        ({**GOOD, "nodes": [{"name": "a", "devices": 2}]}, r"nodes\[0\] = .*accepted: \{name"),
        ([1, 2], "a list; accepted: a mapping"),
        ({**GOOD, "nodes": [node(name="")]}, r"nodes\[0\] name ''; accepted: a name that is not empty"),
    ],
)
def test_bad_topologies_are_refused(data, message):
    with pytest.raises(InputError, match=message):
        parse_topology(data)


def test_load_from_yaml(tmp_path):
    f = tmp_path / "t.yaml"
    f.write_text("intra_node_gbytes_per_s: 600\nnodes:\n  - {name: a, devices: 2, uplink_gbytes_per_s: 10}\n"
                 "device_memory_bytes: 1000000\n")
    t = load_topology(f)
    assert t.devices == 2 and t.device_memory_bytes == 1_000_000
    # Rates in exponent form are numbers (YAML 1.1, PyYAML's, read `1e3` as a string and it was refused)
    f.write_text("intra_node_gbytes_per_s: 6e2\nnodes:\n  - {name: a, devices: 2, uplink_gbytes_per_s: 1.25E+1}\n")
    assert load_topology(f).uplink_bytes_per_s.tolist() == [12.5e9] and load_topology(f).intra_node_gbytes_per_s == 600
    f.write_text("nodes: [unclosed\n")
    with pytest.raises(InputError, match="not valid YAML"):
        load_topology(f)
    with pytest.raises(InputError, match="no such topology file"):
        load_topology(tmp_path / "missing.yaml")
