"""Static checks of docker-compose.yml, deploy/Dockerfile and the agent's systemd unit (no Docker engine here)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
UNIT = ROOT / "deploy" / "phalanx-agent.service"

SCRIPTS: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
SERVICES: dict[str, dict] = yaml.safe_load(COMPOSE.read_text())["services"]
AGENTS = sorted(name for name in SERVICES if re.fullmatch(r"agent-\d+", name))
VOLUME_INIT = "checkpoints-init"  # hands the checkpoints volume to the services' non-root user, as root
ONE_SHOT = {"migrate", VOLUME_INIT}
PHALANX_SERVICES = sorted(name for name, svc in SERVICES.items() if "build" in svc or svc.get("image") == "phalanx:dev")
# The services whose command is a Phalanx program (the volume's init step runs chown).
PHALANX_COMMANDS = [name for name in PHALANX_SERVICES if name != VOLUME_INIT]


def argv(service: str) -> list[str]:
    command = SERVICES[service].get("command", [])
    return shlex.split(command) if isinstance(command, str) else [str(part) for part in command]


def flag(args: list[str], name: str) -> str:
    assert name in args, f"{name} missing from {args}"
    return args[args.index(name) + 1]


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def healthcheck_text(service: str) -> str:
    test = SERVICES[service]["healthcheck"]["test"]
    return " ".join(test) if isinstance(test, list) else test


def console_scripts() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group="console_scripts")}


def test_expected_services_exist():
    for name in ("postgres", "migrate", "scheduler", "checkpointd"):
        assert name in SERVICES, f"service {name} missing"
    assert len(AGENTS) >= 4, f"need at least 4 simulated agents, found {AGENTS}"
    assert AGENTS[:4] == ["agent-0", "agent-1", "agent-2", "agent-3"]
    assert SERVICES["postgres"]["image"].startswith("postgres:16")


def test_phalanx_services_build_from_deploy_dockerfile():
    assert set(PHALANX_SERVICES) >= {"migrate", "scheduler", "checkpointd", VOLUME_INIT, *AGENTS}
    for name in PHALANX_SERVICES:
        build = SERVICES[name]["build"]
        assert (ROOT / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE


@pytest.mark.parametrize("service", PHALANX_COMMANDS)
def test_command_is_an_installed_console_script(service):
    exe = argv(service)[0]
    assert exe in SCRIPTS, f"{service}: {exe!r} is not in [project.scripts] {sorted(SCRIPTS)}"
    installed = console_scripts()
    assert exe in installed, f"{service}: {exe} has no installed entry point; reinstall with pip install -e ."
    assert installed[exe].value == SCRIPTS[exe], f"{exe}: installed entry point is stale ({installed[exe].value})"
    bin_dir = str(Path(sys.executable).parent)
    assert shutil.which(exe, path=bin_dir + os.pathsep + os.environ.get("PATH", "")), f"{exe} not on PATH"


@pytest.mark.parametrize("service", PHALANX_COMMANDS)
@pytest.mark.slow
def test_command_flags_are_accepted(service):
    """`<script> [subcommands] --help` must mention every flag the compose command passes."""
    args = argv(service)
    module = SCRIPTS[args[0]].split(":")[0]
    try:
        found = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        found = None
    if found is None:
        pytest.skip(f"{module} (entry point of {args[0]}) is not in the tree yet")
    subcommands = []
    for part in args[1:]:
        if part.startswith("-"):
            break
        subcommands.append(part)
    exe = Path(sys.executable).parent / args[0]
    result = subprocess.run([str(exe), *subcommands, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    for part in args[1:]:
        if part.startswith("--"):
            assert part in result.stdout, f"{args[0]} {' '.join(subcommands)} does not accept {part}"


@pytest.mark.parametrize("service", sorted(set(SERVICES) - ONE_SHOT))
def test_long_running_services_have_healthchecks(service):
    check = SERVICES[service].get("healthcheck")
    assert check and check.get("test"), f"{service} has no healthcheck"
    if isinstance(check["test"], list):
        assert check["test"][0] in ("CMD", "CMD-SHELL"), f"{service}: healthcheck test must start with CMD or CMD-SHELL"


def test_grpc_healthchecks_probe_the_listen_port():
    for service in ("scheduler", "checkpointd"):
        listen = flag(argv(service), "--listen")
        assert listen.startswith("0.0.0.0:"), f"{service} must listen on all interfaces in a container"
        text = healthcheck_text(service)
        assert "grpc_health" in text and f"127.0.0.1:{port_of(listen)}" in text
        published = [str(p).rsplit(":", 1)[-1] for p in SERVICES[service].get("ports", [])]
        assert all(p == str(port_of(listen)) for p in published), f"{service} publishes {published}"


def test_depends_on_conditions():
    valid = {"service_started", "service_healthy", "service_completed_successfully"}
    for name, svc in SERVICES.items():
        deps = svc.get("depends_on", {})
        assert isinstance(deps, dict), f"{name}: depends_on must use the long form with conditions"
        for dep, spec in deps.items():
            assert dep in SERVICES, f"{name} depends on unknown service {dep}"
            assert spec.get("condition") in valid, f"{name} -> {dep}: condition {spec.get('condition')!r}"
            if spec["condition"] == "service_healthy":
                assert "healthcheck" in SERVICES[dep], f"{name} waits for {dep} to be healthy but it has no healthcheck"
            if spec["condition"] == "service_completed_successfully":
                assert dep in ONE_SHOT
    assert SERVICES["migrate"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    assert str(SERVICES["migrate"].get("restart")) == "no"
    for name in ("scheduler", "checkpointd"):
        assert SERVICES[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    for name in AGENTS:
        assert SERVICES[name]["depends_on"]["scheduler"]["condition"] == "service_healthy"


def test_database_urls_match_postgres():
    env = SERVICES["postgres"]["environment"]
    expected = f"postgresql://{env['POSTGRES_USER']}:{env['POSTGRES_PASSWORD']}@postgres:5432/{env['POSTGRES_DB']}"
    assert env["POSTGRES_USER"] in healthcheck_text("postgres") and "pg_isready" in healthcheck_text("postgres")
    assert argv("migrate")[:3] == ["phalanx", "db", "upgrade"]
    for name in ("migrate", "scheduler", "checkpointd"):
        assert flag(argv(name), "--db") == expected, name
    for name in PHALANX_SERVICES:
        assert SERVICES[name].get("environment", {}).get("PHALANX_DB", expected) == expected, name


def test_agents_use_the_scheduler_listen_port():
    scheduler_port = port_of(flag(argv("scheduler"), "--listen"))
    names = set()
    for name in AGENTS:
        args = argv(name)
        assert args[0] == "phalanx-agent"
        assert flag(args, "--scheduler") == f"scheduler:{scheduler_port}"
        assert flag(args, "--simulate") == "dgx-h100"
        node = flag(args, "--node-name")
        assert node == f"node-{name.split('-')[1]}"
        names.add(node)
        assert SERVICES[name]["environment"]["PHALANX_NODE_NAME"] == node, "healthcheck would ask for another node"
        assert f"scheduler:{scheduler_port}" in healthcheck_text(name)
    assert len(names) == len(AGENTS), "node names must be unique"


def dockerfile_ids() -> tuple[int, int]:
    """The (uid, gid) deploy/Dockerfile creates its user with, which its USER line must name."""
    text = DOCKERFILE.read_text()
    uid = re.search(r"useradd\b[^\n]*--uid (\d+)", text)
    gid = re.search(r"groupadd\b[^\n]*--gid (\d+)", text)
    assert uid and gid, "deploy/Dockerfile must create its user with a fixed --uid and --gid"
    user = re.search(r"^USER (\S+)$", text, re.M)
    assert user and user.group(1) == f"{uid.group(1)}:{gid.group(1)}", "USER must be the numeric uid:gid"
    return int(uid.group(1)), int(gid.group(1))


def volume_mounts(service: str) -> dict[str, str]:
    """{named volume: mount path} of a service (short syntax SOURCE:TARGET[:MODE], or the long one)."""
    mounts = {}
    for entry in SERVICES[service].get("volumes", []):
        if isinstance(entry, str):
            source, target = entry.split(":")[:2]
        else:
            source, target = entry.get("source"), entry["target"]
        mounts[source] = target
    return mounts


def test_checkpoint_volume_belongs_to_the_services_user():
    """Docker creates a named volume root-owned where the image has no mount point, and an old volume keeps its owner:
    a one-shot step as root hands it to the non-root user before any service that writes it starts."""
    uid, gid = dockerfile_ids()
    writers = sorted(name for name in SERVICES if name != VOLUME_INIT and "checkpoints" in volume_mounts(name))
    assert set(writers) == {"checkpointd", *AGENTS}, writers
    path = volume_mounts("checkpointd")["checkpoints"]
    assert flag(argv("checkpointd"), "--checkpoint-dir") == path, "the coordinator's store is the volume"
    init = SERVICES[VOLUME_INIT]
    assert str(init["user"]) in ("0", "0:0", "root"), "only root can chown a root-owned volume"
    assert volume_mounts(VOLUME_INIT) == {"checkpoints": path}
    assert argv(VOLUME_INIT) == ["chown", "-R", f"{uid}:{gid}", path]
    assert str(init.get("restart")) == "no" and not init.get("depends_on")
    for name in writers:
        assert volume_mounts(name)["checkpoints"] == path, f"{name} mounts the store elsewhere"
        assert str(SERVICES[name].get("user")) == f"{uid}:{gid}", f"{name} must run as the image's user"
        dep = SERVICES[name]["depends_on"].get(VOLUME_INIT)
        assert dep == {"condition": "service_completed_successfully"}, f"{name} must wait for {VOLUME_INIT}"
    for name in PHALANX_COMMANDS:
        assert str(SERVICES[name].get("user")) == f"{uid}:{gid}", f"{name} must not run as root"
    # A fresh volume takes the mount point's ownership from the image, too.
    text = DOCKERFILE.read_text()
    assert f"mkdir -p {path}" in text and f"chown {uid}:{gid} {path}" in text


def test_dockerfile():
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM python:3\.11-slim", text, re.M)
    assert re.search(r"pip (install|wheel) .*\.", text), "the image must pip-install the project"
    assert text.index("tools/genproto.py") < text.index("pip wheel"), "protos must exist before package discovery"
    for path in ("pyproject.toml", "setup.py", "tools/", "proto/", "services/", "db/", "migrations/", "phalanx/"):
        assert path in text, f"Dockerfile does not copy {path}"
        assert (ROOT / path).exists()


def _unit_sections(text: str) -> dict[str, dict[str, list[str]]]:
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def test_systemd_unit_runs_the_agent():
    unit = _unit_sections(UNIT.read_text())
    assert {"Unit", "Service", "Install"} <= set(unit)
    (exec_start,) = unit["Service"]["ExecStart"]
    exe = shlex.split(exec_start)[0]
    assert Path(exe).name == "phalanx-agent" and Path(exe).name in SCRIPTS
    assert "--scheduler" in exec_start and "--node-name" in exec_start
    assert unit["Service"]["Restart"] == ["on-failure"]
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]


def _compose_command() -> list[str] | None:
    """`docker compose` (the v2 plugin), else the standalone `docker-compose` (v1, Debian's package; it needs no
    engine for `config` either); None when neither is installed."""
    docker = shutil.which("docker")
    if docker is not None:
        probe = subprocess.run([docker, "compose", "version"], capture_output=True, text=True, timeout=30)
        if probe.returncode == 0:
            return [docker, "compose"]
    standalone = shutil.which("docker-compose")
    return [standalone] if standalone else None


def test_docker_compose_config():
    """Compose's own validation of the file (schema, anchors, depends_on), without a Docker engine."""
    compose = _compose_command()
    if compose is None:
        pytest.skip("neither the docker compose plugin nor docker-compose is installed")
    result = subprocess.run(
        [*compose, "-f", str(COMPOSE), "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
