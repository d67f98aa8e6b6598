"""A re-plan decision is a typed value, written as decision.json and parsed back at that edge."""

from __future__ import annotations

import json

import pytest

from shardflow.errors import InputError
from shardflow.sharding.stage import ReplanDecision, parse_decision


def test_a_decision_survives_its_record():
    for d in (ReplanDecision(True, "no previous plan (a cold start)", 3.1e-4, None),
              ReplanDecision(False, "kept the previous placement", 3.0e-4, 2.9e-4)):
        assert parse_decision(json.loads(json.dumps(d.record()))) == d


@pytest.mark.parametrize("record, message", [
    ({"reason": "x", "fresh_comm_time_s": 1.0, "previous_comm_time_s": None},
     r"d.json: replanned = missing; accepted: bool"),
    ({"replanned": 1, "reason": "x", "fresh_comm_time_s": 1.0, "previous_comm_time_s": None},
     r"replanned = 1; accepted: bool"),
    ({"replanned": True, "reason": "x", "fresh_comm_time_s": True, "previous_comm_time_s": None},
     r"fresh_comm_time_s = True; accepted: int or float"),
    ({"replanned": True, "reason": "x", "fresh_comm_time_s": 1.0, "previous_comm_time_s": "0.1"},
     r"previous_comm_time_s = '0.1'; accepted: int or float or none"),
])
def test_a_damaged_record_is_refused_naming_the_key(record, message):
    with pytest.raises(InputError, match=message):
        parse_decision(record, "d.json")
