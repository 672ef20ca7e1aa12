"""The randomized invariant checker (issue 30): generated scenarios through the decision core in a model of the
world (phalanx.testing.world), the invariants (phalanx.core.invariants) asserted after every step.

Size in CI: 300 scenarios of 1 to 40 actions each (submits of 1-64 GPU gangs, whole or partial, with and without
time limits, in queues with a cohort or none; time passing; releases confirmed late and out of order; checkpoints
committing early, late or never; rank failures, node deaths and returns, GPU failures, MIG mode switches,
cancels), on 2 to 32 nodes of mixed fabrics, then a quiet drain to the end (liveness). About 10 decisions per
action: some 40,000 decisions and a few seconds. Derandomized, so a CI run is the same run every time;
bench/invariants.py runs 100,000 seeded scenarios for the long run."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from phalanx.core import invariants as inv
from phalanx.testing.world import ClusterSpec, Scenario, format_actions, parse_actions, run
from tests.helpers.scenarios import scenarios

pytestmark = pytest.mark.unit

SCENARIOS = 300


@settings(
    max_examples=SCENARIOS,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(scenarios())
def test_every_invariant_holds_on_generated_scenarios(scenario: Scenario) -> None:
    world = run(scenario)
    assert not world.violations, (
        f"{world.violations[0]}\n{scenario.cluster} queues={scenario.queues} min_runtime={scenario.min_runtime_s} "
        f"grace={scenario.grace_s}\n{format_actions(scenario.actions)}"
    )
    assert isinstance(world.history[-1], inv.Event.__args__)  # type: ignore[attr-defined]


# The reproduction: a whole-cluster critical gang preempts a batch gang whose two nodes confirm their
# releases 6 s apart.
REPRO = Scenario(
    ClusterSpec(nodes=3, gpus=8, per_leaf=4),
    parse_actions(
        """
        submit batch 2x8 p=-100 work=300 ckpt=never
        advance 6          # past its 5 s minimum runtime
        submit critical 3x8 p=200 work=20
        advance 4          # its 3 s grace period ends: stopped, its nodes hold its GPUs until they confirm
        release 1          # node-02 confirms
        advance 6
        release 0          # node-01 confirms, 6 s later
        advance 30
        """
    ),
    min_runtime_s=5,
    grace_s=3,
)


def test_the_checker_catches_the_preemption_loop_when_the_claim_is_off() -> None:
    """The checker's own test: the decision with claims turned off is the bug the issue reports, and the checker
    says so; with claims, the same scenario holds every invariant."""
    broken = run(REPRO, claims=False)
    assert broken.violations, "the checker missed the preemption loop of a decision without claims"
    assert broken.violations[0].invariant == "c" and "preempted again by critical" in broken.violations[0].what
    starts = [(e.job, e.attempt) for e in broken.history if isinstance(e, inv.Started)]
    assert starts[:2] == [("batch", 1), ("batch", 2)]  # the victim took its GPUs back first

    fixed = run(REPRO)
    assert not fixed.violations, fixed.violations
    starts = [(e.t, e.job) for e in fixed.history if isinstance(e, inv.Started)]
    assert starts == [(0.0, "batch"), (16.0, "critical"), (36.0, "batch")]  # critical at the last release
    asked = [e.victim for e in fixed.history if isinstance(e, inv.Asked)]
    assert asked == ["batch"]  # preempted once


def test_generated_scenarios_find_violations_of_a_decision_without_claims() -> None:
    """Over generated scenarios, the decision with claims off breaks the invariants (the checker is not blind to
    the class of bugs it exists for), and the one with claims does not, on the same scenarios."""
    import random

    from phalanx.testing.world import random_scenario

    seeds = range(400)
    broken = [s for s in seeds if run(random_scenario(random.Random(s)), claims=False).violations]
    assert len(broken) >= 3, broken
    assert not [s for s in broken if run(random_scenario(random.Random(s))).violations]


# Serving (invariant g): a rolling update's surge replica that does not fit waits for a release; it never asks a
# running gang to checkpoint, even one of lower priority that an ordinary gang of its priority would preempt.
SURGE = Scenario(
    ClusterSpec(nodes=2, gpus=8, per_leaf=2),
    parse_actions(
        """
        submit batch 2x8 p=0 work=20 ckpt=early
        advance 6
        submit surge 2x8 p=100 work=10 surge
        advance 10
        submit critical 1x8 p=200 work=5
        advance 60
        """
    ),
    min_runtime_s=5,
    grace_s=3,
)


def test_a_surge_replica_waits_for_a_release_instead_of_preempting() -> None:
    world = run(SURGE)
    assert not world.violations, world.violations
    asked = [e for e in world.history if isinstance(e, inv.Asked)]
    assert [e.by for e in asked] == ["critical"]  # the ordinary gang preempts; the surge never does
    starts = [e.job for e in world.history if isinstance(e, inv.Started)]
    assert starts.index("surge") > starts.index("batch")


def test_the_checker_flags_a_surge_replica_that_preempts() -> None:
    history = [
        inv.Cluster(0.0, {"n1": 8}),
        inv.Submitted(0.0, "batch", 0, replicas=1, gpus_per_replica=8),
        inv.Started(1.0, "batch", 1, tuple(inv.Hold("n1", g) for g in range(8)), 8),
        inv.Submitted(2.0, "surge", 100, replicas=1, gpus_per_replica=8, preempts=False),
        inv.Asked(3.0, "batch", 1, "surge"),
    ]
    assert [v.invariant for v in inv.check(history)] == ["g"]


# Elastic gangs (invariant h): an elastic gang starts with what fits, grows when capacity frees (a restart through
# the checkpoint handshake, as its own "victim") and shrinks at once when one of its nodes dies.
ELASTIC = Scenario(
    ClusterSpec(nodes=4, gpus=8, per_leaf=4),
    parse_actions(
        """
        submit other 2x8 p=0 work=10
        submit grower 4x8 p=0 work=200 min=1 ckpt=early
        advance 11      # other ends: the grower checkpoints, is stopped and waits for its GPUs' release
        release 0
        release 0
        advance 20
        down 0          # one of its nodes dies: it restarts smaller once the survivors' GPUs are released
        release 0
        release 0
        release 0
        advance 400
        """
    ),
    min_runtime_s=5,
    grace_s=3,
)


def test_an_elastic_gang_grows_and_shrinks_within_its_range() -> None:
    world = run(ELASTIC)
    assert not world.violations, world.violations
    sizes = [len(e.holds) // 8 for e in world.history if isinstance(e, inv.Started) and e.job == "grower"]
    outcomes = [e.outcome for e in world.history if isinstance(e, inv.Ended) and e.job == "grower"]
    assert sizes[0] == 2 and 4 in sizes, sizes  # started with what fit, grew to its maximum
    assert "RESIZED" in outcomes and "NODE_LOST" in outcomes and outcomes[-1] == "SUCCEEDED", outcomes
    after_loss = sizes[outcomes.index("NODE_LOST") + 1]
    assert 1 <= after_loss < 4  # restarted smaller, never below its minimum
    assert world.jobs["grower"].failures == 0  # a shrink is no failure
