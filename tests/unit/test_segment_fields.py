"""The segment fields of a JobSpec (services/scheduler/segment_fields.py): every problem in words, the static
"no domain could ever hold it" check, the jobs.shape JSON both ways, and the SDK's request."""

from __future__ import annotations

import pytest

from phalanx.api.v1 import common_pb2
from phalanx.client._client import build_submit_request
from services.common.errors import InvalidArgument
from services.scheduler.segment_fields import (
    check_segments_fit,
    placed_segments,
    segment_never_fits,
    segment_problems,
    shape_into_spec,
    shape_of_spec,
)

TIERS = ["node", "nvlink", "leaf", "spine", "cluster"]
FABRIC = ("nvlink", "leaf", "spine")
# 2 NVLink domains of 18 trays x 4 GPUs and one of 4 trays, under one leaf
NODES = [(f"gb{i:03d}", 4, (f"nvl-{i // 18}", "leaf0", "spine0"), "NVIDIA GB200") for i in range(40)]


def spec(**kw) -> common_pb2.JobSpec:
    return common_pb2.JobSpec(name="x", replicas=kw.pop("replicas", 36), gpus_per_replica=4, command=["run"], **kw)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        (dict(segment=-2), "segment must be 0"),
        (dict(segment=5), "segment 5 does not divide replicas 36"),
        (dict(segment=18, segment_tier="rack"), "segment_tier 'rack' is not a tier"),
        (dict(segment_tier="leaf"), "segment_tier needs segment"),
        (dict(replicas=2, segment=1, gpu_milli=500), "segments need whole GPUs"),
    ],
)
def test_problems(fields, words):
    (problem,) = [p for p in segment_problems(spec(**fields), TIERS) if words in p]
    assert problem


def test_no_problems_and_a_plain_gang():
    assert segment_problems(spec(segment=18), TIERS) == []
    assert segment_problems(spec(segment=18, segment_tier="leaf"), TIERS) == []
    assert segment_problems(spec(segment=18, min_replicas=18), TIERS) == []  # an elastic gang of 1 to 2 segments
    assert segment_problems(spec(), TIERS) == []


def test_a_segment_no_domain_could_ever_hold():
    assert segment_never_fits(NODES, spec(segment=18), FABRIC) == ""
    assert "largest holds 18 such replica(s)" in segment_never_fits(NODES, spec(replicas=38, segment=19), FABRIC)
    # 3 segments of 18: the two racks hold 2, the small domain none
    assert "hold 2 such segment(s) even when empty" in segment_never_fits(NODES, spec(replicas=54, segment=18), FABRIC)
    assert segment_never_fits(NODES, spec(replicas=40, segment=20, segment_tier="leaf"), FABRIC) == ""
    assert segment_never_fits(NODES, spec(replicas=4, segment=2, gpu_model="H100"), FABRIC) == ""  # no such node yet
    assert segment_never_fits([], spec(segment=18), FABRIC) == ""  # no node registered: FAILED_PRECONDITION later


def test_check_raises_invalid_argument():
    class Node:
        def __init__(self, name, gpus, path, gpu_model):
            self.name, self.gpus, self.path, self.gpu_model = name, gpus, list(path), gpu_model

    nodes = [Node(*n) for n in NODES]
    check_segments_fit(nodes, spec(segment=18), FABRIC)
    with pytest.raises(InvalidArgument, match="fits in no nvlink domain of this cluster even when empty"):
        check_segments_fit(nodes, spec(replicas=38, segment=19), FABRIC)


def test_shape_json_both_ways_and_the_sdk_request():
    assert shape_of_spec(spec()) == {}
    shape = shape_of_spec(spec(segment=18, segment_tier="nvlink"))
    assert shape == {"segment": 18, "segment_tier": "nvlink"}
    back = common_pb2.JobSpec()
    shape_into_spec(shape, back)
    assert (back.segment, back.segment_tier) == (18, "nvlink")
    assert placed_segments({"segments": ["nvl-0", "nvl-1"]}) == ["nvl-0", "nvl-1"] and placed_segments({}) == []
    request = build_submit_request(
        "x", 36, 4, "run", priority=0, procs_per_replica=0, env=None, request_id="r", segment=18, segment_tier="nvlink"
    )
    assert (request.spec.segment, request.spec.segment_tier) == (18, "nvlink")
