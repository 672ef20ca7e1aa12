"""The scheduler view's job table: its index by state always equals a scan of the table, in the table's order."""

from __future__ import annotations

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.state import JobRecord, JobTable, SchedulerState, touch

STATES = ["PENDING", "RUNNING", "SUCCEEDED", "FAILED"]


def job(i: int, state: str = "PENDING") -> JobRecord:
    return JobRecord(
        id=f"j{i}",
        name=f"job-{i}",
        state=state,
        priority=0,
        replicas=1,
        gpus_per_replica=1,
        procs_per_replica=1,
        command=["true"],
        env={},
        submitted_at=float(i),
    )


def scan(table: dict[str, JobRecord], state: str) -> list[str]:
    return [j.id for j in table.values() if j.state == state]


def indexed(table: JobTable, state: str) -> list[str]:
    return list(table.in_state(state))


def test_a_state_change_moves_the_job_between_indexes_in_table_order():
    table = JobTable({f"j{i}": job(i) for i in range(5)})
    table["j3"].state = "RUNNING"
    table["j1"].state = "RUNNING"
    assert indexed(table, "RUNNING") == ["j1", "j3"]  # the table's order, not the order they started in
    assert indexed(table, "PENDING") == ["j0", "j2", "j4"]
    table["j1"].state = "PENDING"  # requeued: back in its place
    assert indexed(table, "PENDING") == ["j0", "j1", "j2", "j4"]
    table["j3"].state = "SUCCEEDED"
    assert indexed(table, "RUNNING") == [] and table.count("PENDING") == 4


def test_a_copy_of_a_record_does_not_move_the_original_in_the_index():
    table = JobTable({"j0": job(0, "RUNNING")})
    ended = copy.copy(table["j0"])
    ended.state = "SUCCEEDED"
    assert indexed(table, "RUNNING") == ["j0"] and table["j0"].state == "RUNNING"
    assert ended.__dict__["state"] == "SUCCEEDED"  # the value lives in __dict__, as a plain field's would


def test_replacing_and_removing_records_keeps_the_index():
    table = JobTable({f"j{i}": job(i) for i in range(3)})
    old = table["j1"]
    table["j1"] = job(1, "RUNNING")  # a fresh record for the same job (a delta from another replica)
    assert indexed(table, "RUNNING") == ["j1"] and indexed(table, "PENDING") == ["j0", "j2"]
    old.state = "PENDING"  # the replaced record no longer belongs to the table
    assert indexed(table, "PENDING") == ["j0", "j2"]
    assert table.pop("j0").id == "j0" and table.pop("nope", None) is None
    del table["j2"]
    assert indexed(table, "PENDING") == [] and list(table) == ["j1"]


def test_the_view_wraps_a_loaded_dict_and_releases_the_old_records():
    state = SchedulerState()
    state.jobs["j0"] = job(0)
    first = state.jobs["j0"]
    state.jobs = {"j1": job(1, "RUNNING"), "j2": job(2)}  # a reload
    assert isinstance(state.jobs, JobTable)
    assert [j.id for j in state.running()] == ["j1"] and [j.id for j in state.pending()] == ["j2"]
    first.state = "RUNNING"
    assert [j.id for j in state.running()] == ["j1"]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["set", "state", "del", "replace", "touch"]), st.integers(0, 7), st.sampled_from(STATES)
        ),
        max_size=60,
    )
)
def test_the_index_always_equals_a_scan(ops):
    table = JobTable()
    plain: dict[str, JobRecord] = {}
    for op, i, state in ops:
        key = f"j{i}"
        if op == "set" and key not in table:
            record = job(i, state)
            table[key] = record
            plain[key] = record
        elif op == "state" and key in table:
            table[key].state = state
        elif op == "del" and key in table:
            del table[key]
            del plain[key]
        elif op == "replace" and key in table:
            record = job(i, state)
            table[key] = record
            plain[key] = record
        elif op == "touch" and key in table:
            table[key].version += 1
            touch(table[key])
        assert table.pending_view(built) == [built(j) for j in plain.values() if j.state == "PENDING"]
        for s in ("PENDING", "RUNNING"):
            assert indexed(table, s) == scan(plain, s)
            assert sorted(j.id for j in table.unordered(s)) == sorted(scan(plain, s))


def built(job: JobRecord) -> tuple:
    return (job.id, job.priority, job.version)


def test_the_pending_view_rebuilds_only_what_entered_the_queue_or_was_touched():
    table = JobTable({f"j{i}": job(i) for i in range(4)})
    calls: list[str] = []

    def build(j: JobRecord) -> tuple:
        calls.append(j.id)
        return built(j)

    assert table.pending_view(build) == [built(table[f"j{i}"]) for i in range(4)] and len(calls) == 4
    calls.clear()
    assert table.pending_view(build) == [built(table[f"j{i}"]) for i in range(4)] and calls == []  # nothing changed
    table["j1"].priority = 7
    table["j1"].version += 1
    touch(table["j1"])  # what ledger.update_job and transitions.set_job do
    table["j2"].state = "RUNNING"
    table["j9"] = job(9)
    assert table.pending_view(build) == [built(table[i]) for i in ("j0", "j1", "j3", "j9")]
    assert sorted(calls) == ["j1", "j9"]
    table["j2"].state = "PENDING"  # back in its place, out of arrival order
    assert [v[0] for v in table.pending_view(build)] == ["j0", "j1", "j2", "j3", "j9"]
