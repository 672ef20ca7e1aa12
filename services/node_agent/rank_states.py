"""The life cycle of a rank on its node agent, as a table: pure, no process, no server, no database.

    starting --started--> running           the wrapper's status file says the command runs
    starting --adopted--> running           a restarted agent finds the wrapper alive (running --adopted--> running)
    starting|running --exited--> exited     the command ended with an exit status
    starting --failed--> failed             the command could not be started (FAILED_TO_START)
    starting|running --killed--> killed     killed on request (the scheduler, a stale report, fencing, shutdown)
    starting|running --lost--> lost         the process is gone with no exit status, or another ledger's rank

`exited`, `failed`, `killed` and `lost` are final: a rank leaves them never (its record is forgotten once the
scheduler took its last report). A rank that was running cannot fail to start. The agent's rank supervisor
(supervisor.py) moves a RankRecord through `advance`.
"""

from __future__ import annotations

STARTING, RUNNING, EXITED, FAILED, KILLED, LOST = "starting", "running", "exited", "failed", "killed", "lost"
STATES = (STARTING, RUNNING, EXITED, FAILED, KILLED, LOST)
FINAL = frozenset({EXITED, FAILED, KILLED, LOST})

# Events: what the supervisor learns about a rank.
STARTED, ADOPTED = "started", "adopted"
EVENTS = (STARTED, ADOPTED, EXITED, FAILED, KILLED, LOST)

TRANSITIONS: dict[tuple[str, str], str] = {
    (STARTING, STARTED): RUNNING,
    (STARTING, ADOPTED): RUNNING,
    (RUNNING, ADOPTED): RUNNING,
    (STARTING, EXITED): EXITED,  # it ran and ended while no agent watched (seen at adoption)
    (RUNNING, EXITED): EXITED,
    (STARTING, FAILED): FAILED,
    (STARTING, KILLED): KILLED,
    (RUNNING, KILLED): KILLED,
    (STARTING, LOST): LOST,
    (RUNNING, LOST): LOST,
}


class IllegalRankTransition(ValueError):
    def __init__(self, state: str, event: str) -> None:
        super().__init__(f"a rank that is {state} cannot take the event {event!r}")
        self.state, self.event = state, event


def advance(state: str, event: str) -> str:
    """The rank's state after `event`; IllegalRankTransition when the table has no such move."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise IllegalRankTransition(state, event) from None


def is_final(state: str) -> bool:
    return state in FINAL
