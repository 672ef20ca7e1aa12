"""The gRPC service config the SDK, phalanx.train and (optionally) any channel of open_channel carry for retries."""

from __future__ import annotations

import json

from phalanx.client._channel import MAX_RETRIES, effective_retries, retry_options, retry_service_config


def _policy(config: str) -> dict:
    (method,) = json.loads(config)["methodConfig"]
    assert method["name"] == [{}]  # the default method config: every method of every service on the channel
    return method["retryPolicy"]


def test_the_policy_retries_unavailable_only():
    policy = _policy(retry_service_config(4))
    assert policy == {
        "maxAttempts": 5,
        "initialBackoff": "0.100s",
        "maxBackoff": "2.000s",
        "backoffMultiplier": 2.0,
        "retryableStatusCodes": ["UNAVAILABLE"],
    }


def test_no_retries_is_no_policy():
    assert retry_service_config(0) is None and retry_service_config(-3) is None and retry_options(0) == []


def test_retries_are_clamped_to_grpcs_cap():
    assert MAX_RETRIES == 4 and effective_retries(9) == 4 and effective_retries(-1) == 0
    assert _policy(retry_service_config(50))["maxAttempts"] == 5


def test_backoffs_shrink_to_half_the_deadline():
    # 0.1 + 0.2 + 0.4 + 0.8 s (+20% jitter) = 1.8 s worst case: fits in half of 10 s, not in half of 1 s.
    assert _policy(retry_service_config(4, budget=10))["initialBackoff"] == "0.100s"
    policy = _policy(retry_service_config(4, budget=1))
    assert policy["initialBackoff"] == "0.028s" and policy["maxBackoff"] == "0.556s"


def test_the_options_turn_retries_on_and_dns_service_configs_off():
    options = dict(retry_options(2, backoff=(0.4, 2.0)))
    assert options["grpc.enable_retries"] == 1 and options["grpc.service_config_disable_resolution"] == 1
    assert _policy(options["grpc.service_config"])["initialBackoff"] == "0.400s"
