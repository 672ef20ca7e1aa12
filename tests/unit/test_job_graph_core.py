"""The pure parts of job graphs: Slurm's --array syntax (phalanx.core.arrays) and dependency resolution
(phalanx.core.dependencies)."""

from __future__ import annotations

import pytest

from phalanx.core import dependencies
from phalanx.core.arrays import ArrayError, parse_array, task_env, task_name


@pytest.mark.parametrize(
    "text, indices, limit",
    [
        ("0-99%8", list(range(100)), 8),
        ("1,3,5-7", [1, 3, 5, 6, 7], 0),
        ("0-99:2%4", list(range(0, 100, 2)), 4),
        ("7", [7], 0),
        ("5-7,1,6", [1, 5, 6, 7], 0),  # overlaps count once, in order
        (" 0-3 %2", [0, 1, 2, 3], 2),
        ("0-10000", list(range(10001)), 0),  # Slurm's default MaxArraySize is 10001
    ],
)
def test_array_specs_parse_as_slurm_reads_them(text, indices, limit):
    spec = parse_array(text)
    assert list(spec.indices) == indices and spec.limit == limit and spec.size == len(indices)


@pytest.mark.parametrize(
    "text, needle",
    [
        ("", "empty"),
        ("a-b", "'a-b' is not an index"),
        ("-3", "is not an index"),
        ("1,,2", "'' is not an index"),
        ("9-3", "ends before it starts"),
        ("0-9:0", "step of '0-9:0' must be 1 or more"),
        ("0-9%", "after '%'"),
        ("0-9%0", "after '%'"),
        ("0-9%x", "after '%'"),
        ("0-10001", "index 10001 is over the maximum array size: indices must be 0-10000"),
        ("1" * 2000, "at most 1024"),
    ],
)
def test_bad_array_specs_say_why(text, needle):
    with pytest.raises(ArrayError, match=None) as err:
        parse_array(text)
    assert needle in str(err.value)


def test_the_maximum_array_size_is_configurable():
    assert parse_array("0-99", max_size=100).size == 100
    with pytest.raises(ArrayError, match="--max-array-size is 100"):
        parse_array("0-100", max_size=100)


def test_a_task_has_its_name_and_slurm_like_variables():
    spec = parse_array("2-8:3%1")
    assert task_name("sweep", 5) == "sweep[5]"
    env = task_env("abc", 5, spec)
    assert env["PHALANX_ARRAY_TASK_ID"] == env["SLURM_ARRAY_TASK_ID"] == "5"
    assert env["PHALANX_ARRAY_JOB_ID"] == "abc"
    assert (env["PHALANX_ARRAY_TASK_COUNT"], env["PHALANX_ARRAY_TASK_MIN"], env["PHALANX_ARRAY_TASK_MAX"]) == (
        "3",
        "2",
        "8",
    )


@pytest.mark.parametrize(
    "condition, state, verdict",
    [
        ("ok", "SUCCEEDED", True),
        ("", "SUCCEEDED", True),
        ("ok", "FAILED", False),
        ("ok", "CANCELLED", False),
        ("notok", "FAILED", True),
        ("notok", "CANCELLED", True),
        ("notok", "SUCCEEDED", False),
        ("any", "SUCCEEDED", True),
        ("any", "CANCELLED", True),
        ("ok", "RUNNING", None),
        ("any", "PENDING", None),
    ],
)
def test_a_condition_is_met_never_met_or_not_yet(condition, state, verdict):
    assert dependencies.outcome(condition, state) is verdict


def test_unknown_conditions_are_refused():
    with pytest.raises(ValueError, match="must be ok, notok or any"):
        dependencies.normalize("afterok")
    assert dependencies.normalize(" NotOK ") == "notok"


def test_resolve_marks_met_dependencies_and_names_the_first_that_never_can_be():
    after = [
        {"job_id": "a", "condition": "ok", "met": False},
        {"job_id": "b", "condition": "notok", "met": False},
        {"job_id": "c", "condition": "any", "met": False},
    ]
    resolved, reason = dependencies.resolve(after, {"a": "SUCCEEDED"})
    assert [d["met"] for d in resolved] == [True, False, False] and reason is None
    assert dependencies.waiting_message(resolved) == "waits for job b to fail (and 1 more dependencies)"
    resolved, reason = dependencies.resolve(resolved, {"b": "SUCCEEDED", "c": "FAILED"})
    assert (
        reason
        == "dependency_failed: job b ended SUCCEEDED, and this job needed it to fail or be cancelled (afternotok)"
    )
    assert after[0]["met"] is False  # the input is left as it was
    assert dependencies.waiting_message([{"job_id": "a", "condition": "ok", "met": True}]) == ""


def test_find_cycle_follows_the_waits_for_edges():
    edges = {"b": ["c"], "c": ["a"], "d": []}
    assert dependencies.find_cycle(["b"], "a", lambda j: edges.get(j, [])) == ["b", "c", "a"]
    assert dependencies.find_cycle(["d"], "a", lambda j: edges.get(j, [])) is None
    assert dependencies.find_cycle(["a"], "a", lambda j: []) == ["a"]
