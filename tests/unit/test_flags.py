"""phalanx.common.flags: a flag falls back on its environment variable (then a configuration file, then its
default), a command-line value overrides both, and a bad value from the environment is a usage error naming the
variable. Also the three services' parsers, which are built from it."""

from __future__ import annotations

import argparse

import pytest

from phalanx.common.flags import Flag, FlagError, add_flags


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parser(*flags: Flag, environ: dict[str, str] | None = None, file: dict | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="svc")
    add_flags(p, flags, environ=environ or {}, file=file)
    return p


WATCHES = Flag("--max-watches", env="SVC_MAX_WATCHES", type=_positive, default=64, metavar="N", help="streams")


def test_a_flag_is_read_from_its_environment_variable_and_converted_by_its_type():
    args = parser(WATCHES, environ={"SVC_MAX_WATCHES": "7"}).parse_args([])
    assert args.max_watches == 7 and type(args.max_watches) is int


def test_without_the_variable_the_default_applies():
    assert parser(WATCHES).parse_args([]).max_watches == 64


def test_a_command_line_value_overrides_the_environment():
    assert parser(WATCHES, environ={"SVC_MAX_WATCHES": "7"}).parse_args(["--max-watches", "3"]).max_watches == 3
    # ... even a bad one, which is then never looked at
    assert parser(WATCHES, environ={"SVC_MAX_WATCHES": "x"}).parse_args(["--max-watches", "3"]).max_watches == 3


@pytest.mark.parametrize(
    ("value", "reason"),
    [("x", "invalid literal"), ("0", "must be at least 1, got 0")],
)
def test_a_bad_environment_value_is_a_usage_error_that_names_the_variable(capsys, value, reason):
    with pytest.raises(SystemExit) as exc:
        parser(WATCHES, environ={"SVC_MAX_WATCHES": value}).parse_args([])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --max-watches: environment variable SVC_MAX_WATCHES='{value}'" in err
    if reason == "invalid literal":  # a ValueError is worded as argparse words a bad command-line value
        assert err.rstrip().endswith("invalid _positive value")
    else:
        assert err.rstrip().endswith(reason)


def test_a_bad_environment_value_of_a_builtin_type(capsys):
    flag = Flag("--threshold", env="SVC_THRESHOLD", type=int, default=100)
    with pytest.raises(SystemExit):
        parser(flag, environ={"SVC_THRESHOLD": "many"}).parse_args([])
    err = capsys.readouterr().err
    assert "argument --threshold: environment variable SVC_THRESHOLD='many': invalid int value" in err


def test_a_bad_command_line_value_fails_as_argparse_says_it(capsys):
    flag = Flag("--threshold", env="SVC_THRESHOLD", type=int, default=100)
    with pytest.raises(SystemExit):
        parser(flag).parse_args(["--threshold", "many"])
    assert "argument --threshold: invalid int value: 'many'" in capsys.readouterr().err


def test_a_string_flag_from_the_environment_is_a_plain_string():
    args = parser(Flag("--db", env="SVC_DB", default="sqlite:///x")).parse_args([])
    assert args.db == "sqlite:///x"
    args = parser(Flag("--db", env="SVC_DB", default="sqlite:///x"), environ={"SVC_DB": "postgresql://h/d"}).parse_args(
        []
    )
    assert args.db == "postgresql://h/d" and type(args.db) is str


def test_an_empty_variable_is_its_value_unless_ignore_empty():
    kept = Flag("--listen", env="SVC_LISTEN", default="127.0.0.1:1")
    ignored = Flag("--advertise", env="SVC_ADVERTISE", ignore_empty=True, default="h:2")
    args = parser(kept, ignored, environ={"SVC_LISTEN": "", "SVC_ADVERTISE": ""}).parse_args([])
    assert args.listen == "" and args.advertise == "h:2"


def test_precedence_flag_then_environment_then_file_then_default():
    flags = (
        Flag("--scheduler", env="SVC_SCHEDULER", ignore_empty=True, default="d:1"),
        Flag("--kill-grace", type=float, default=5.0),
    )
    file = {"scheduler": "f:1", "kill_grace": 9}
    assert parser(*flags).parse_args([]).scheduler == "d:1"
    assert parser(*flags, file=file).parse_args([]).scheduler == "f:1"
    assert parser(*flags, file=file, environ={"SVC_SCHEDULER": "e:1"}).parse_args([]).scheduler == "e:1"
    assert parser(*flags, file=file, environ={"SVC_SCHEDULER": "e:1"}).parse_args(["--scheduler", "c:1"]).scheduler == (
        "c:1"
    )
    assert parser(*flags, file=file).parse_args([]).kill_grace == 9


def _truthy(value) -> bool:
    if isinstance(value, str):
        if value.strip().lower() == "maybe":
            raise ValueError("not a yes or a no")
        return value.strip().lower() not in ("0", "false", "no", "off", "")
    return bool(value)


def test_a_boolean_flag_coerces_its_environment_value_when_the_parser_is_built():
    flag = Flag(
        "--mig-manage",
        env="SVC_MIG_MANAGE",
        ignore_empty=True,
        action=argparse.BooleanOptionalAction,
        default=False,
        coerce=_truthy,
    )
    assert parser(flag).parse_args([]).mig_manage is False
    assert parser(flag, environ={"SVC_MIG_MANAGE": "yes"}).parse_args([]).mig_manage is True
    assert parser(flag, environ={"SVC_MIG_MANAGE": "yes"}).parse_args(["--no-mig-manage"]).mig_manage is False
    assert parser(flag, file={"mig_manage": "off"}).parse_args([]).mig_manage is False
    with pytest.raises(FlagError, match="--mig-manage: environment variable SVC_MIG_MANAGE='maybe'"):
        parser(flag, environ={"SVC_MIG_MANAGE": "maybe"})


def test_argparse_defaults_of_switches_are_kept():
    args = parser(
        Flag("--no-backfill", dest="backfill", action="store_false"), Flag("--upgrade", action="store_true")
    ).parse_args([])
    assert args.backfill is True and args.upgrade is False


def test_the_key_and_dest_of_a_flag():
    assert Flag("--node-name").key == "node-name" and Flag("--node-name").dest_name == "node_name"
    assert Flag("--no-backfill", dest="backfill").dest_name == "backfill"


# -- the services' parsers -------------------------------------------------------------------------------------


def test_the_scheduler_reads_its_limits_from_the_environment(monkeypatch, capsys):
    from services.scheduler.main import build_parser

    monkeypatch.setenv("PHALANX_SCHEDULER_MAX_WATCHES", "5")
    monkeypatch.setenv("PHALANX_DB", "sqlite:///elsewhere.db")
    args = build_parser().parse_args([])
    assert args.max_watches == 5 and args.db == "sqlite:///elsewhere.db"
    assert build_parser().parse_args(["--max-watches", "9"]).max_watches == 9
    monkeypatch.setenv("PHALANX_SCHEDULER_MAX_WATCHES", "lots")
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([])
    assert exc.value.code == 2
    assert "environment variable PHALANX_SCHEDULER_MAX_WATCHES='lots'" in capsys.readouterr().err


def test_the_checkpoint_coordinator_names_a_bad_variable(monkeypatch, capsys):
    from services.checkpoint_coordinator.main import parse_args

    monkeypatch.setenv("PHALANX_CHECKPOINTD_FINISHED_CHECKPOINTS", "Latest")
    assert parse_args([]).finished_checkpoints == "latest"
    monkeypatch.setenv("PHALANX_CHECKPOINTD_KEEP_CHECKPOINTS", "0")
    with pytest.raises(SystemExit):
        parse_args([])
    assert "environment variable PHALANX_CHECKPOINTD_KEEP_CHECKPOINTS='0'" in capsys.readouterr().err
    assert parse_args(["--keep-checkpoints", "4"]).keep_checkpoints == 4


def test_the_agent_flag_table_is_its_configuration_file_keys(monkeypatch, capsys):
    from services.node_agent.main import CONFIG_KEYS, parse_args

    assert CONFIG_KEYS["node-name"] == ("node_name", "PHALANX_NODE_NAME")
    assert CONFIG_KEYS["simulate"] == ("simulate", None) and "discover" not in CONFIG_KEYS
    monkeypatch.setenv("PHALANX_ECC_SBE_THRESHOLD", "12")
    assert parse_args([]).ecc_sbe_threshold == 12
    monkeypatch.setenv("PHALANX_ECC_SBE_THRESHOLD", "")  # empty: unset, for the agent
    assert parse_args([]).ecc_sbe_threshold == 100
    monkeypatch.setenv("PHALANX_ECC_SBE_THRESHOLD", "many")
    with pytest.raises(SystemExit):
        parse_args([])
    assert "environment variable PHALANX_ECC_SBE_THRESHOLD='many': invalid int value" in capsys.readouterr().err
