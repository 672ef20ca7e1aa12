"""identity.argv_as: a command run as another user, switched in a fresh process (not by forking the agent)."""

from __future__ import annotations

import os
import subprocess

import pytest

from services.node_agent.identity import agent_user, argv_as, resolve_user


def test_no_user_or_the_agents_own_changes_nothing():
    assert argv_as(None, ["/bin/true", "x"]) == ["/bin/true", "x"]
    assert argv_as(agent_user(), ["/bin/true"]) == ["/bin/true"]


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")
def test_the_command_runs_with_the_users_uid_gid_and_groups_only():
    nobody = resolve_user("nobody")
    out = subprocess.run(
        argv_as(nobody, ["/bin/sh", "-c", 'echo "$(id -u) $(id -g) $(id -G)"']),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert int(out[0]) == nobody.uid and int(out[1]) == nobody.gid
    assert sorted(map(int, out[2:])) == sorted(set(nobody.groups) | {nobody.gid})  # none of root's groups


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")
def test_a_missing_program_fails_in_the_switch_not_as_the_agent():
    r = subprocess.run(argv_as(resolve_user("nobody"), ["/no/such/program"]), capture_output=True, text=True)
    assert r.returncode != 0 and "FileNotFoundError" in r.stderr
