"""Parsing of `phalanx service create/update` (phalanx/cli/service_flags.py): roles, per-role commands and env,
ready probes, the autoscaler's flags, the command after `--`, and update's changes on top of the current spec. A bad
flag is a usage error (exit 2) before anything is sent."""

from __future__ import annotations

import dataclasses

import pytest

from phalanx.cli.common import UsageError
from phalanx.cli.main import build_parser, main
from phalanx.cli.service_flags import (
    parse_ready_http,
    parse_role_command,
    parse_role_env,
    parse_roles,
    spec_from_args,
    updated_spec,
)
from phalanx.client import Autoscale, ReadyProbe, Role, ServiceSpec

BASE = ["service", "create", "llm", "--replicas", "2", "--gpus-per-node", "8"]


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def create(*flags: str, command=("run",)) -> ServiceSpec:
    return spec_from_args(parse(*BASE, *flags, "--", *command))


def test_roles():
    assert parse_roles("prefill:2,decode:1") == [Role("prefill", 2), Role("decode", 1)]
    assert parse_roles(" leader:1 ") == [Role("leader", 1)]
    for bad in ("prefill", "prefill:0", "prefill:x", "Prefill:1", "a:1,,b:1", "p:-1"):
        with pytest.raises(ValueError, match="--roles takes NAME:NODES"):
            parse_roles(bad)
    with pytest.raises(ValueError, match="repeated: a"):
        parse_roles("a:1,a:2")


def test_role_commands_and_env():
    assert parse_role_command("decode=python -m decode --port '9 000'") == (
        "decode",
        ["python", "-m", "decode", "--port", "9 000"],
    )
    assert parse_role_command("a=x=y") == ("a", ["x=y"])
    for bad, match in (("decode", "ROLE='CMD ARGS'"), ("=x", "ROLE='CMD ARGS'"), ("a=", "empty"), ("a='x", "quot")):
        with pytest.raises(ValueError, match=match):
            parse_role_command(bad)
    assert parse_role_env("decode:KV_CACHE=fp8") == ("decode", "KV_CACHE", "fp8")
    assert parse_role_env("decode:A=") == ("decode", "A", "")
    for bad in ("decode", "decode:A", ":A=1", "decode:=1"):
        with pytest.raises(ValueError, match="ROLE:KEY=VALUE"):
            parse_role_env(bad)


def test_ready_http():
    assert parse_ready_http("8000/health") == (8000, "/health")
    assert parse_ready_http(":8000/v1/models") == (8000, "/v1/models")
    assert parse_ready_http("8000") == (8000, "/")
    assert parse_ready_http("8000/") == (8000, "/")
    for bad in ("health", "0/health", "70000/x", "/health", "80a/x", ""):
        with pytest.raises(ValueError, match="--ready-http takes PORT/PATH"):
            parse_ready_http(bad)


def test_a_create_command_line_makes_its_spec():
    spec = create(
        "--nodes-per-replica",
        "2",
        "--priority",
        "high",
        "--queue",
        "serving",
        "--start-order",
        "leader-first",
        "--spread-tier",
        "leaf",
        "--ready-http",
        "8000/health",
        "--ready-period",
        "5",
        "--port",
        "8000",
        "--restart",
        "none",
        "--max-unavailable",
        "0",
        "--max-surge",
        "1",
        "--env",
        "A=1",
        "B=x=y",
        command=("vllm", "serve", "--port", "8000", "--", "--after-dashes"),
    )
    assert spec.command == ["vllm", "serve", "--port", "8000", "--", "--after-dashes"]  # verbatim after the first --
    assert (spec.name, spec.replicas, spec.nodes_per_replica, spec.gpus_per_node) == ("llm", 2, 2, 8)
    assert (spec.priority, spec.queue, spec.start_order, spec.spread_tier, spec.port) == (
        100,
        "serving",
        "leader-first",
        "leaf",
        8000,
    )
    assert spec.ready_probe == ReadyProbe(http_port=8000, http_path="/health", period_s=5.0)
    assert (spec.restart, spec.max_unavailable, spec.max_surge, spec.autoscale) == ("never", 0, 1, None)
    assert spec.env == {"A": "1", "B": "x=y"}
    template = spec.to_proto().template
    assert template.restart == "never" and template.replicas == 2 and template.ready_probe.http_port == 8000


def test_roles_with_their_own_commands():
    spec = create(
        "--roles",
        "prefill:2,decode:1",
        "--role-command",
        "prefill=python -m prefill --kv 'a b'",
        "--role-env",
        "decode:KV=fp8",
        "--ready-cmd",
        "curl -sf localhost:8000/health",
    )
    assert spec.roles == [
        Role("prefill", 2, ["python", "-m", "prefill", "--kv", "a b"]),
        Role("decode", 1, [], {"KV": "fp8"}),
    ]
    assert spec.nodes == 3 and spec.to_proto().template.replicas == 0  # the scheduler adds the roles up
    assert spec.ready_probe == ReadyProbe(command=["curl", "-sf", "localhost:8000/health"])


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--role-command", "decoder=run"], "--role-command: no role named 'decoder'; the roles are: prefill, decode"),
        (["--role-env", "x:A=1"], "--role-env: no role named 'x'; the roles are: prefill, decode"),
        (["--nodes-per-replica", "2"], "--nodes-per-replica 2, but --roles add up to 3 nodes"),
    ],
)
def test_per_role_options_must_name_a_role(flags, message):
    with pytest.raises(UsageError) as err:
        create("--roles", "prefill:2,decode:1", *flags)
    assert str(err.value) == message


def test_a_per_role_option_without_roles():
    with pytest.raises(UsageError, match=r"no role named 'a'; the roles are: none \(give --roles\)"):
        create("--role-command", "a=run")


def test_the_autoscaler_flags():
    spec = spec_from_args(
        parse(
            "service", "create", "llm", "--gpus-per-node", "8", "--min", "2", "--max", "6", "--metric",
            "vllm:num_requests_waiting", "--target", "10", "--metrics-port", "8000", "--scale-down-window", "120",
            "--", "run",
        )
    )  # fmt: skip
    assert spec.replicas == 2  # no --replicas: it starts at --min
    assert spec.autoscale == Autoscale(2, 6, "vllm:num_requests_waiting", 10.0, 8000, "", 120.0)
    for flags, message in (
        (["--max", "4"], "needs --max, --metric and --target together"),
        (["--metric", "m", "--target", "1"], "needs --max, --metric and --target together"),
        (["--min", "2"], "the autoscaler needs --max, --metric and --target"),
        (["--min", "5", "--max", "4", "--metric", "m", "--target", "1"], "--max 4 is below --min 5"),
        (["--max", "4", "--metric", "m", "--target", "1", "--metrics-path", "metrics"], "must start with '/'"),
    ):
        with pytest.raises(UsageError, match=message):
            create(*flags)


def test_probe_timings_need_a_probe():
    with pytest.raises(UsageError, match="need --ready-cmd or --ready-http"):
        create("--ready-timeout", "3")


@pytest.mark.parametrize(
    "argv, message",
    [
        ([*BASE[:3], "--gpus-per-node", "8", "--", "run"], "--replicas is required"),
        ([*BASE], "a command is required"),
        ([*BASE, "--replicas", "0", "--", "run"], "--replicas must be 1 to 10000, got 0"),
        ([*BASE, "--roles", "p", "--", "run"], "--roles takes NAME:NODES"),
        ([*BASE, "--ready-http", "8000/x", "--ready-cmd", "true", "--", "run"], "not allowed with argument"),
        ([*BASE, "--restart", "sometimes", "--", "run"], "invalid choice: 'sometimes'"),
        ([*BASE, "--start-order", "random", "--", "run"], "invalid choice: 'random'"),
        (["service", "get", "llm", "--", "x"], "this command takes no command after --"),
        (["service", "scale", "llm", "-1"], "K must be 0 to 10000, got -1"),
        (["apply"], "the following arguments are required: -f/--file"),
    ],
)
def test_usage_errors_exit_2(argv, message, capsys, monkeypatch):
    monkeypatch.setenv("PHALANX_SCHEDULER", "127.0.0.1:1")  # nothing must be sent
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and message in err and err.count("error:") == 1


def test_update_changes_only_what_is_given():
    current = ServiceSpec(
        "llm",
        3,
        nodes_per_replica=3,
        gpus_per_node=8,
        command=["serve", "v1"],
        env={"A": "1", "B": "2"},
        roles=[Role("prefill", 2), Role("decode", 1, ["decode"])],
        ready_probe=ReadyProbe(http_port=8000, http_path="/health"),
        priority=100,
        max_unavailable=1,
        max_surge=0,
    )

    def update(*flags: str) -> ServiceSpec:
        return updated_spec(current, parse("service", "update", "llm", *flags))

    assert update() == current
    assert update("--", "serve", "v2") == dataclasses.replace(current, command=["serve", "v2"])
    assert update("--env", "B=3", "C=4", "--unset-env", "A").env == {"B": "3", "C": "4"}
    changed = update("--role-command", "prefill=prefill --fast", "--ready-timeout", "5", "--max-surge", "1")
    assert changed.roles[0] == Role("prefill", 2, ["prefill", "--fast"]) and changed.roles[1] == current.roles[1]
    assert changed.ready_probe == ReadyProbe(http_port=8000, http_path="/health", timeout_s=5.0)
    assert changed.max_surge == 1 and changed.priority == 100 and changed.command == current.command
    regrouped = update("--roles", "prefill:1,decode:1")
    assert regrouped.roles == [Role("prefill", 1), Role("decode", 1)] and regrouped.nodes_per_replica == 0
    assert update("--no-ready-probe").ready_probe is None
    assert update("--ready-cmd", "true").ready_probe == ReadyProbe(command=["true"])
    with pytest.raises(UsageError, match="no role named 'x'; the roles are: prefill, decode"):
        update("--role-command", "x=run")
    with pytest.raises(UsageError, match="--unset-env Z: the service has no such variable"):
        update("--unset-env", "Z")
    # update takes no service-level flags: those are apply's and scale's
    with pytest.raises(SystemExit):
        parse("service", "update", "llm", "--replicas", "4")
