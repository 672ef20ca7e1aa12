"""The autoscaler's rule (phalanx.core.autoscale), HPA's: the ratio to the target, the tolerance, the stabilization
windows, the bounds, and no move without data."""

from __future__ import annotations

from phalanx.core.autoscale import AutoscalePolicy, AutoscaleState, recommend

POLICY = AutoscalePolicy(1, 6, "vllm:num_requests_waiting", target=10.0, scale_down_window_s=60.0)


def test_scales_by_the_ratio_of_the_average_to_the_target_within_bounds():
    state = AutoscaleState()
    assert recommend(POLICY, 2, [30, 30], 0.0, state).replicas == 6
    assert recommend(POLICY, 2, [100, 100], 1.0, AutoscaleState()).replicas == 6  # capped at max
    assert recommend(POLICY, 2, [10.5, 10.5], 0.0, AutoscaleState()).replicas == 2  # within the 10% tolerance


def test_a_scale_down_waits_out_the_window_and_takes_its_highest_recommendation():
    state = AutoscaleState()
    recommend(POLICY, 4, [10] * 4, 0.0, state)  # 4 wanted at t=0
    assert recommend(POLICY, 4, [1] * 4, 30.0, state).replicas == 4  # the dip is inside the window
    assert recommend(POLICY, 4, [1] * 4, 61.0, state).replicas == 1  # the window passed: down to the floor


def test_a_scale_up_window_makes_a_spike_last():
    policy = AutoscalePolicy(1, 10, "m", target=1.0, scale_up_window_s=30.0, scale_down_window_s=0.0)
    state = AutoscaleState()
    recommend(policy, 2, [1, 1], 0.0, state)
    assert recommend(policy, 2, [5, 5], 10.0, state).replicas == 2  # 2 was wanted 10 s ago
    assert recommend(policy, 2, [5, 5], 41.0, state).replicas == 10


def test_no_data_keeps_the_count_and_a_bad_policy_says_why():
    assert recommend(POLICY, 3, [], 0.0, AutoscaleState()).replicas == 3
    bad = AutoscalePolicy(0, -1, "", target=0.0)
    assert len(bad.problems()) == 4
