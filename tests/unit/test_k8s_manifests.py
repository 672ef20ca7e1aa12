"""Offline checks of the Kubernetes manifests in deploy/kubernetes/ (README, "Kubernetes").

Schemas: every built-in kind strictly (an unknown field fails) against the Kubernetes JSON schemas that the
`kubernetes-validate` package vendors (no network), and with `kubeconform` too where that binary is on PATH and
can reach its schemas; CloudNativePG's Cluster, which has no upstream schema, against the minimal one vendored in
deploy/kubernetes/schemas/ (with `jsonschema`, else structural asserts). Then what no schema sees: every Secret,
ConfigMap, claim and service account a pod names exists (or is the one CloudNativePG generates), every flag given to
a Phalanx program is one of its parser's, every file a flag names is mounted, the probes and Services point at
declared ports, and the node agent gets what NVML and cgroups need. The scripts the pods run (config.yaml) are run
here too: the TLS gRPC health probe, the wait for the ledger's schema, the agent's cgroup entry point.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from concurrent import futures
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
CNPG_SCHEMA = K8S / "schemas" / "postgresql.cnpg.io" / "cluster_v1.json"
KUSTOMIZATION: dict[str, Any] = yaml.safe_load((K8S / "kustomization.yaml").read_text())
NAMESPACE = "phalanx"
IMAGE = "ghcr.io/phalanx-project/phalanx:latest"
# The keys of the `<cluster>-app` Secret CloudNativePG generates for a Cluster's application user.
CNPG_APP_SECRET_KEYS = {"username", "password", "host", "port", "dbname", "uri", "jdbc-uri", "pgpass", "fqdn-uri"}
# Kubernetes versions the built-in kinds are validated against: the oldest still common, and the newest known.
K8S_VERSIONS = ("1.28.0", "latest")
# Sample values of the downward-API variables the agent's arguments use ($(NAME) is expanded by kubelet).
SAMPLE_ENV = {"NODE_NAME": "gpu-node-01", "NODE_IP": "10.0.0.17"}


def _load() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((path.name, doc))
    return docs


DOCS = _load()
MANIFESTS = [doc for _, doc in DOCS]


def of_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in MANIFESTS if d["kind"] == kind}


def one(kind: str, name: str) -> dict[str, Any]:
    found = of_kind(kind)
    assert name in found, f"no {kind} {name} in deploy/kubernetes (have {sorted(found)})"
    return found[name]


WORKLOAD_KINDS = ("Deployment", "DaemonSet", "StatefulSet", "Job")
WORKLOADS = {f"{d['kind']}/{d['metadata']['name']}": d for d in MANIFESTS if d["kind"] in WORKLOAD_KINDS}


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    found = {c["name"]: c for c in containers(pod_spec(workload))}
    assert name in found, f"{workload['metadata']['name']} has no container {name} (has {sorted(found)})"
    return found[name]


def env_of(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in c.get("env", [])}


def expand(value: str, c: dict[str, Any]) -> str:
    """kubelet's $(VAR) expansion, with sample values for the downward API's fields."""

    def one_var(m: re.Match) -> str:
        name = m.group(1)
        assert name in env_of(c), f"{c['name']}: $({name}) names no env variable of the container (left unexpanded)"
        return SAMPLE_ENV.get(name) or env_of(c)[name].get("value", f"<{name}>")

    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one_var, value)


def argv(c: dict[str, Any]) -> list[str]:
    return [expand(str(part), c) for part in [*c.get("command", []), *c.get("args", [])]]


def flag(args: list[str], name: str) -> str:
    assert name in args, f"{name} missing from {args}"
    return args[args.index(name) + 1]


def script(name: str) -> str:
    data = one("ConfigMap", "phalanx-scripts")["data"]
    assert name in data, f"phalanx-scripts has no {name}"
    return data[name]


def dockerfile_ids() -> tuple[int, int]:
    text = DOCKERFILE.read_text()
    uid = re.search(r"useradd\b[^\n]*--uid (\d+)", text)
    gid = re.search(r"groupadd\b[^\n]*--gid (\d+)", text)
    assert uid and gid, "deploy/Dockerfile must create its user with a fixed --uid and --gid"
    return int(uid.group(1)), int(gid.group(1))


def program(c: dict[str, Any]) -> tuple[str, list[str]]:
    """(the Phalanx program a container runs, its arguments): the agent's entry point script execs phalanx-agent
    with the container's args; `python /etc/phalanx/scripts/X.py ...` runs a script of phalanx-scripts."""
    args = argv(c)
    if args[:1] == ["/bin/sh"] and args[1].startswith("/etc/phalanx/scripts/"):
        text = script(Path(args[1]).name)
        assert 'exec phalanx-agent "$@"' in text, f"{args[1]} must exec phalanx-agent with the container's args"
        return "phalanx-agent", args[2:]
    if args[:1] == ["python"] and args[1].startswith("/etc/phalanx/scripts/"):
        return "script:" + Path(args[1]).name, args[2:]
    return args[0], args[1:]


PHALANX_CONTAINERS = [
    (key, c["name"]) for key, w in WORKLOADS.items() for c in containers(pod_spec(w)) if c["image"] == IMAGE
]


def _container(key_and_name: tuple[str, str]) -> dict[str, Any]:
    key, name = key_and_name
    return container(WORKLOADS[key], name)


# -- the set of manifests -----------------------------------------------------------------------------------------


def test_kustomization_lists_every_manifest_but_the_secrets_example():
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    resources = set(KUSTOMIZATION["resources"])
    assert "secrets.example.yaml" not in resources, "its placeholders would overwrite the real Secrets on apply -k"
    assert resources == files - {"secrets.example.yaml"}, f"not listed: {sorted(files - resources)}"
    assert KUSTOMIZATION["namespace"] == NAMESPACE
    (image,) = KUSTOMIZATION["images"]
    assert f"{image['name']}:{image['newTag']}" == IMAGE


CLUSTER_SCOPED = {"Namespace", "PriorityClass"}


def test_every_object_is_in_the_phalanx_namespace():
    for name, doc in DOCS:
        assert doc["metadata"].get("labels", {}).get("app.kubernetes.io/part-of") == "phalanx", name
        if doc["kind"] == "Namespace":
            assert doc["metadata"]["name"] == NAMESPACE
        if doc["kind"] in CLUSTER_SCOPED:
            assert "namespace" not in doc["metadata"], f"{name}: {doc['kind']} is cluster-scoped"
            continue
        assert doc["metadata"].get("namespace") == NAMESPACE, f"{name}: {doc['kind']}/{doc['metadata']['name']}"


def test_every_phalanx_container_runs_the_one_image():
    assert PHALANX_CONTAINERS, "no container runs the Phalanx image"
    for key, w in WORKLOADS.items():
        for c in containers(pod_spec(w)):
            assert c["image"] == IMAGE, f"{key}/{c['name']}: {c['image']}"


def test_kustomize_build_renders_every_resource():
    exe = shutil.which("kustomize") or shutil.which("kubectl")
    if exe is None:
        pytest.skip("neither kustomize nor kubectl is on PATH")
    cmd = [exe, "build", str(K8S)] if Path(exe).name == "kustomize" else [exe, "kustomize", str(K8S)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    rendered = [d for d in yaml.safe_load_all(result.stdout) if d]
    expected = [d for name, d in DOCS if name != "secrets.example.yaml"]
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    assert sorted(map(key, rendered)) == sorted(map(key, expected))
    for d in rendered:
        if d["kind"] not in CLUSTER_SCOPED:
            assert d["metadata"]["namespace"] == NAMESPACE


# -- schemas ------------------------------------------------------------------------------------------------------


def _builtin_docs() -> list[tuple[str, dict[str, Any]]]:
    return [(name, d) for name, d in DOCS if d["apiVersion"] != "postgresql.cnpg.io/v1"]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_builtin_kinds_match_the_kubernetes_schemas(version):
    import kubernetes_validate as kv  # the test extra: the Kubernetes JSON schemas, vendored, offline

    if version == "latest":
        latest = kv.latest_version()
        version = latest if isinstance(latest, str) else ".".join(str(p) for p in latest)
    for name, doc in _builtin_docs():
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as exc:
            where = "/".join(str(p) for p in exc.path) if hasattr(exc, "path") else ""
            pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']} at {where}: {exc.message}")
    # The validator is strict: a misspelt field of a pod template fails (so the pass above means something).
    broken = copy.deepcopy(one("Deployment", "phalanx-scheduler"))
    pod_spec(broken)["containers"][0]["readinesProbe"] = pod_spec(broken)["containers"][0]["readinessProbe"]
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, version, strict=True)


def test_kubeconform():
    exe = shutil.which("kubeconform")
    if exe is None:
        pytest.skip("kubeconform is not on PATH (the kubernetes-validate test covers the schemas offline)")
    files = [str(K8S / name) for name in sorted({name for name, _ in DOCS})]
    result = subprocess.run(
        [
            exe,
            "-strict",
            "-summary",
            "-kubernetes-version",
            "1.28.0",
            "-schema-location",
            "default",
            "-schema-location",
            str(K8S / "schemas" / "{{.Group}}" / "{{.ResourceKind}}_{{.ResourceAPIVersion}}.json"),
            *files,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = result.stdout + result.stderr
    if result.returncode != 0 and re.search(r"downloading schema|could not find schema|no such host|dial tcp", out):
        pytest.skip(f"kubeconform cannot reach its schemas offline: {out.strip().splitlines()[-1]}")
    assert result.returncode == 0, out


def test_cnpg_cluster_matches_the_vendored_schema():
    schema = json.loads(CNPG_SCHEMA.read_text())
    clusters = of_kind("Cluster")
    assert list(clusters) == ["phalanx-db"]
    cluster = clusters["phalanx-db"]
    bad_instances = copy.deepcopy(cluster)
    bad_instances["spec"]["instances"] = 0
    no_storage = copy.deepcopy(cluster)
    del no_storage["spec"]["storage"]
    misspelt = copy.deepcopy(cluster)
    misspelt["spec"]["instance"] = 3
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    if jsonschema is not None:
        validator = jsonschema.Draft202012Validator(schema)
        jsonschema.Draft202012Validator.check_schema(schema)
        errors = [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(cluster)]
        assert not errors, errors
        for broken in (bad_instances, no_storage, misspelt):
            assert not validator.is_valid(broken)
    # The same essentials without jsonschema (and what a schema cannot say).
    assert cluster["apiVersion"] == "postgresql.cnpg.io/v1" and cluster["kind"] == "Cluster"
    spec = cluster["spec"]
    assert isinstance(spec["instances"], int) and spec["instances"] == 3
    assert re.fullmatch(r"[0-9]+(Ki|Mi|Gi|Ti)", spec["storage"]["size"])
    assert 0 < spec.get("minSyncReplicas", 0) <= spec.get("maxSyncReplicas", 0) < spec["instances"]
    assert spec["bootstrap"]["initdb"] == {"database": "phalanx", "owner": "phalanx"}


# -- cross-references ---------------------------------------------------------------------------------------------


def generated_secrets() -> dict[str, set[str]]:
    """The Secrets operators make from these manifests: CloudNativePG's `<cluster>-app`."""
    return {f"{name}-app": CNPG_APP_SECRET_KEYS for name in of_kind("Cluster")}


def secret_keys() -> dict[str, set[str]]:
    keys = {name: set(s.get("data", {})) | set(s.get("stringData", {})) for name, s in of_kind("Secret").items()}
    return {**keys, **generated_secrets()}


def configmap_keys() -> dict[str, set[str]]:
    return {name: set(cm.get("data", {})) for name, cm in of_kind("ConfigMap").items()}


@pytest.mark.parametrize("key", sorted(WORKLOADS))
def test_everything_a_pod_names_exists(key):
    spec = pod_spec(WORKLOADS[key])
    secrets, configmaps = secret_keys(), configmap_keys()
    assert spec.get("serviceAccountName") in of_kind("ServiceAccount"), f"{key}: service account"
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    mounted = set()
    for v in volumes.values():
        if "secret" in v:
            name = v["secret"]["secretName"]
            assert name in secrets, f"{key}: volume {v['name']}: no Secret {name}"
            for item in v["secret"].get("items", []):
                assert item["key"] in secrets[name], f"{key}: Secret {name} has no key {item['key']}"
        if "configMap" in v:
            name = v["configMap"]["name"]
            assert name in configmaps, f"{key}: volume {v['name']}: no ConfigMap {name}"
        if "persistentVolumeClaim" in v:
            claim = v["persistentVolumeClaim"]["claimName"]
            assert claim in of_kind("PersistentVolumeClaim"), f"{key}: no PersistentVolumeClaim {claim}"
    for c in containers(spec):
        for m in c.get("volumeMounts", []):
            assert m["name"] in volumes, f"{key}/{c['name']}: mounts undeclared volume {m['name']}"
            mounted.add(m["name"])
        for source in c.get("envFrom", []):
            if "configMapRef" in source:
                assert source["configMapRef"]["name"] in configmaps
            if "secretRef" in source:
                assert source["secretRef"]["name"] in secrets
        for e in c.get("env", []):
            ref = e.get("valueFrom", {})
            if "secretKeyRef" in ref:
                name, k = ref["secretKeyRef"]["name"], ref["secretKeyRef"]["key"]
                assert name in secrets and k in secrets[name], f"{key}/{c['name']}: {e['name']} from {name}/{k}"
            if "configMapKeyRef" in ref:
                name, k = ref["configMapKeyRef"]["name"], ref["configMapKeyRef"]["key"]
                assert name in configmaps and k in configmaps[name], f"{key}/{c['name']}: {e['name']}"
    assert mounted == set(volumes), f"{key}: volumes mounted nowhere: {sorted(set(volumes) - mounted)}"


def _parse(prog: str, args: list[str], capsys) -> Any:
    """The program's own argparse parser on `args` (a usage error fails the test with argparse's message)."""
    try:
        if prog == "phalanx-scheduler":
            from services.scheduler.main import build_parser

            return build_parser().parse_args(args)
        if prog == "phalanx-checkpointd":
            from services.checkpoint_coordinator.main import parse_args

            return parse_args(args)
        if prog == "phalanx-agent":
            from services.node_agent.main import build_parser as agent_parser

            return agent_parser().parse_args(args)
        if prog == "phalanx":
            from phalanx.cli.main import build_parser as cli_parser

            return cli_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"{prog} {shlex.join(args)}: {capsys.readouterr().err.strip().splitlines()[-1]}")
    raise AssertionError(f"unknown program {prog}")


@pytest.mark.parametrize("key_and_name", PHALANX_CONTAINERS, ids=lambda k: f"{k[0]}/{k[1]}")
def test_every_flag_is_a_real_flag(key_and_name, capsys):
    c = _container(key_and_name)
    prog, args = program(c)
    if prog.startswith("script:"):
        text = script(prog.split(":", 1)[1])
        for part in args:
            if part.startswith("--"):
                assert f'"{part}"' in text, f"{prog} has no argument {part}"
        return
    if prog == "phalanx-agent":
        entry = script(Path(argv(c)[1]).name)
        for extra in re.findall(r'exec phalanx-agent "\$@" (.*)', entry):
            args = [*args, *shlex.split(extra.replace('"$own/ranks"', "/kubepods/pod/ctr/ranks"))]
    parsed = _parse(prog, args, capsys)
    if prog == "phalanx":
        assert args[:2] == ["db", "upgrade"], args
    else:
        assert "--db" not in args, f"{prog}: the ledger URL (and its password) belongs in PHALANX_DB, not in argv"
    assert parsed is not None


def _mounts(c: dict[str, Any], spec: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    return [(m["mountPath"].rstrip("/"), volumes[m["name"]]) for m in c.get("volumeMounts", [])]


def _check_file(path: str, c: dict[str, Any], spec: dict[str, Any], where: str) -> None:
    path = path.rstrip("/")
    found = [(mp, v) for mp, v in _mounts(c, spec) if path == mp or path.startswith(mp + "/")]
    assert found, f"{where}: {path} lies in no volume mount of {c['name']}"
    mount_path, volume = max(found, key=lambda f: len(f[0]))
    rest = path[len(mount_path) + 1 :]
    if not rest:  # the mount itself (a directory the flag names)
        return
    if "secret" in volume:
        keys = secret_keys()[volume["secret"]["secretName"]]
    elif "configMap" in volume:
        keys = configmap_keys()[volume["configMap"]["name"]]
    else:
        return
    if rest == SAMPLE_ENV["NODE_NAME"]:  # /etc/phalanx/agent-tokens/$(NODE_NAME): one key per node
        return
    assert rest in keys, f"{where}: {path}: {volume['name']} has no key {rest} (has {sorted(keys)})"


@pytest.mark.parametrize("key_and_name", PHALANX_CONTAINERS, ids=lambda k: f"{k[0]}/{k[1]}")
def test_files_named_by_flags_env_and_probes_are_mounted(key_and_name):
    key, _ = key_and_name
    c, spec = _container(key_and_name), pod_spec(WORKLOADS[key])
    words = list(argv(c))
    words += [expand(e["value"], c) for e in c.get("env", []) if "value" in e]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        words += c.get(probe, {}).get("exec", {}).get("command", [])
    for word in words:
        if word.startswith(("/etc/phalanx/", "/var/lib/phalanx/")):
            _check_file(word, c, spec, key)


def _listen_port(c: dict[str, Any]) -> int:
    return int(flag(program(c)[1], "--listen").rsplit(":", 1)[1])


def _probe_ports(c: dict[str, Any]) -> list[int | str]:
    ports: list[int | str] = []
    for name in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = c.get(name)
        if not probe:
            continue
        if "exec" in probe:
            cmd = probe["exec"]["command"]
            assert cmd[:2] == ["python", "/etc/phalanx/scripts/grpc-health.py"], f"{c['name']} {name}: {cmd}"
            host, _, port = cmd[2].rpartition(":")
            assert host == "127.0.0.1", f"{c['name']} {name}: probes the pod's own server"
            ports.append(int(port))
        for handler in ("grpc", "tcpSocket", "httpGet"):
            if handler in probe:
                ports.append(probe[handler]["port"])
    return ports


@pytest.mark.parametrize(
    ("deployment", "service"),
    [("phalanx-scheduler", "phalanx-scheduler"), ("phalanx-checkpointd", "phalanx-checkpointd")],
)
def test_probes_and_services_point_at_declared_ports(deployment, service):
    w = one("Deployment", deployment)
    (main,) = pod_spec(w)["containers"]
    declared = {p["name"]: p["containerPort"] for p in main["ports"]}
    listen = _listen_port(main)
    assert declared["grpc"] == listen, f"{deployment}: grpc port {declared['grpc']} but --listen :{listen}"
    probes = _probe_ports(main)
    assert {"readinessProbe", "livenessProbe"} <= set(main), f"{deployment} needs readiness and liveness probes"
    for port in probes:
        assert port in (*declared, *declared.values()), f"{deployment}: a probe asks port {port}"
        assert declared.get(port, port) == listen, f"{deployment}: probes must ask the gRPC health service"
    for name in ("startupProbe", "readinessProbe", "livenessProbe"):
        if "exec" in main.get(name, {}):
            cmd = main[name]["exec"]["command"]
            assert flag(cmd, "--server-name") == service, "the name the probe checks in the server's certificate"
            assert flag(cmd, "--ca") == "/etc/phalanx/ca/ca.crt"
    if "metrics" in declared:
        args = program(main)[1]
        assert int(flag(args, "--metrics-port")) == declared["metrics"]
        assert flag(args, "--metrics-host") == "0.0.0.0", "metrics served on loopback only cannot be scraped"
    svc = one("Service", service)
    labels = w["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert w["spec"]["selector"]["matchLabels"].items() <= labels.items()
    selected = [
        k
        for k, other in WORKLOADS.items()
        if svc["spec"]["selector"].items() <= other["spec"]["template"]["metadata"].get("labels", {}).items()
    ]
    assert selected == [f"Deployment/{deployment}"], f"Service {service} selects {selected}"
    for port in svc["spec"]["ports"]:
        target = port.get("targetPort", port["port"])
        assert target in declared or target in declared.values(), f"{service}: targetPort {target} not declared"
        assert declared.get(target, target) == port["port"], f"{service}: port {port['port']} -> {target}"


# -- the workloads ------------------------------------------------------------------------------------------------


def _db_from_cnpg(c: dict[str, Any]) -> None:
    (cluster,) = of_kind("Cluster")
    ref = env_of(c)["PHALANX_DB"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": f"{cluster}-app", "key": "uri"}, f"{c['name']}: PHALANX_DB from {ref}"


def test_services_take_the_ledger_from_the_cloudnativepg_app_secret():
    for key, name in PHALANX_CONTAINERS:
        c = _container((key, name))
        prog, _ = program(c)
        if prog in ("phalanx-scheduler", "phalanx-checkpointd", "phalanx", "script:wait-for-ledger.py"):
            _db_from_cnpg(c)
    job = one("Job", "phalanx-db-upgrade")
    (upgrade,) = pod_spec(job)["containers"]
    assert argv(upgrade) == ["phalanx", "db", "upgrade"]
    for deployment in ("phalanx-scheduler", "phalanx-checkpointd"):
        (init,) = pod_spec(one("Deployment", deployment))["initContainers"]
        assert program(init)[0] == "script:wait-for-ledger.py", f"{deployment} must wait for the schema"


@pytest.mark.parametrize("key", sorted(k for k in WORKLOADS if k != "DaemonSet/phalanx-agent"))
def test_control_plane_pods_run_as_the_image_user(key):
    uid, gid = dockerfile_ids()
    spec = pod_spec(WORKLOADS[key])
    ctx = spec["securityContext"]
    assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] == uid and ctx["runAsGroup"] == gid
    assert not spec.get("hostNetwork") and not spec.get("hostPID")
    for c in containers(spec):
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
        assert not sc.get("privileged") and sc.get("runAsUser", uid) == uid
        assert c["resources"]["requests"]["memory"] and c["resources"]["limits"]["memory"], c["name"]
    assert re.search(r"^USER (\d+):(\d+)$", DOCKERFILE.read_text(), re.M).groups() == (str(uid), str(gid))


def test_scheduler_is_two_fenced_replicas_with_tokens_and_tls():
    w = one("Deployment", "phalanx-scheduler")
    assert w["spec"]["replicas"] == 2
    text = (K8S / "scheduler.yaml").read_text()
    assert "leader lease" in text and "epoch" in text, "say how leadership is fenced (the ledger, not Kubernetes)"
    (main,) = pod_spec(w)["containers"]
    replica = env_of(main)["PHALANX_REPLICA_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert replica == "metadata.name", "every replica needs its own --replica-id"
    args = program(main)[1]
    assert flag(args, "--tokens") == "/etc/phalanx/tokens/tokens.yaml"
    assert flag(args, "--tls-cert") == "/etc/phalanx/tls/tls.crt"
    assert flag(args, "--tls-key") == "/etc/phalanx/tls/tls.key"
    assert main["envFrom"] == [{"configMapRef": {"name": "phalanx-config"}}]
    pdb = one("PodDisruptionBudget", "phalanx-scheduler")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= w["spec"]["template"]["metadata"]["labels"].items()


def test_checkpoint_root_is_one_shared_volume():
    claim = one("PersistentVolumeClaim", "phalanx-checkpoints")
    assert "ReadWriteMany" in claim["spec"]["accessModes"], "the coordinator and every agent mount it"
    coordinator = one("Deployment", "phalanx-checkpointd")
    (main,) = pod_spec(coordinator)["containers"]
    args = program(main)[1]
    root = flag(args, "--checkpoint-root")
    assert flag(args, "--checkpoint-dir") == root
    assert flag(args, "--advertise") == f"phalanx-checkpointd:{_listen_port(main)}"
    agent = one("DaemonSet", "phalanx-agent")
    for w, c in ((coordinator, main), (agent, container(agent, "agent"))):
        mounts = dict(_mounts(c, pod_spec(w)))
        assert root in mounts, f"{w['metadata']['name']} does not mount the checkpoint root at {root}"
        assert mounts[root]["persistentVolumeClaim"]["claimName"] == "phalanx-checkpoints", w["metadata"]["name"]
    assert coordinator["spec"]["replicas"] == 1


def test_agent_daemonset_gets_what_nvml_and_cgroups_need():
    w = one("DaemonSet", "phalanx-agent")
    spec = pod_spec(w)
    assert spec["nodeSelector"]["nvidia.com/gpu.present"] == "true"
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["hostPID"] is True and spec["hostNetwork"] is True
    assert spec["dnsPolicy"] == "ClusterFirstWithHostNet", "with hostNetwork, else the Services do not resolve"
    tolerated = {t["key"] for t in spec["tolerations"]}
    assert {"nvidia.com/gpu", "phalanx.io/dedicated"} <= tolerated
    c = container(w, "agent")
    assert c["securityContext"]["privileged"] is True and c["securityContext"]["runAsUser"] == 0
    assert "limits" not in c["resources"], "the ranks run in the agent's cgroup: a limit would cap every job"
    env = env_of(c)
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["NODE_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert "utility" in env["NVIDIA_DRIVER_CAPABILITIES"]["value"], "utility: NVML"
    raw = [*c.get("command", []), *c.get("args", [])]
    assert flag(raw, "--node-name") == "$(NODE_NAME)" and flag(raw, "--address") == "$(NODE_IP)"
    assert flag(raw, "--token-file") == "/etc/phalanx/agent-tokens/$(NODE_NAME)"
    scheduler_port = one("Service", "phalanx-scheduler")["spec"]["ports"][0]["port"]
    assert flag(raw, "--scheduler") == f"phalanx-scheduler:{scheduler_port}"
    assert flag(raw, "--pass-env") == "PHALANX_TLS_CA" and "PHALANX_TLS_CA" in env
    mounts = dict(_mounts(c, spec))
    ro = {m["mountPath"]: m.get("readOnly", False) for m in c["volumeMounts"]}
    for path in ("/dev", "/sys/fs/cgroup"):
        assert mounts[path]["hostPath"]["path"] == path and ro[path] is False, f"{path}: the host's, read-write"
    state = flag(raw, "--state-dir")
    assert "hostPath" in mounts[state], "the state file must outlive the pod: a rank is never started twice"
    tokens = mounts["/etc/phalanx/agent-tokens"]["secret"]
    assert tokens["secretName"] == "phalanx-agent-tokens"
    assert tokens["defaultMode"] & 0o077 == 0, "the agent refuses a token file others may read"
    assert w["spec"]["updateStrategy"]["type"] == "OnDelete"
    assert spec["priorityClassName"] in of_kind("PriorityClass"), "its own class: the last pod evicted"
    text = (K8S / "agent.yaml").read_text()
    assert "device plugin" in text and "nvidia.com/gpu.deploy.device-plugin" in text


def test_agent_tokens_example_names_its_nodes():
    from phalanx.common.tokens import TokenFileError, parse_tokens

    entries = yaml.safe_load(one("Secret", "phalanx-tokens")["stringData"]["tokens.yaml"])
    nodes = {e["node"] for e in entries if e.get("role") == "node"}
    agent_tokens = set(one("Secret", "phalanx-agent-tokens")["stringData"])
    assert agent_tokens and agent_tokens == nodes, "each node's token key needs a node entry naming that node"
    with pytest.raises(TokenFileError):  # the placeholders cannot be mistaken for real hashes
        parse_tokens(one("Secret", "phalanx-tokens")["stringData"]["tokens.yaml"])
    tls = one("Secret", "phalanx-tls")
    assert tls["type"] == "kubernetes.io/tls" and set(tls["stringData"]) == {"tls.crt", "tls.key"}
    assert set(one("Secret", "phalanx-ca")["stringData"]) == {"ca.crt"}, "the CA apart: agents never get the key"


# -- the scripts the pods run -------------------------------------------------------------------------------------


def _write_script(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    path.write_text(script(name))
    return path


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **kw.pop("env", {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, **kw)


def test_agent_entrypoint_moves_itself_out_of_the_container_cgroup(tmp_path):
    entry = _write_script(tmp_path, "agent-entrypoint.sh")
    assert _run(["sh", "-n", str(entry)]).returncode == 0
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_agent = bin_dir / "phalanx-agent"
    fake_agent.write_text('#!/bin/sh\necho "pid=$$"\nfor a in "$@"; do echo "arg=$a"; done\n')
    fake_agent.chmod(0o755)
    fs = tmp_path / "cgroup"
    own = "/kubepods.slice/pod1.slice/cri-containerd-abc.scope"
    (fs / own.lstrip("/")).mkdir(parents=True)
    (fs / "cgroup.controllers").write_text("cpu memory pids\n")
    self_cgroup = tmp_path / "self-cgroup"
    self_cgroup.write_text(f"0::{own}\n")
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PHALANX_ENTRYPOINT_CGROUPFS": str(fs),
        "PHALANX_ENTRYPOINT_SELF_CGROUP": str(self_cgroup),
    }
    procs = fs / own.lstrip("/") / "cgroup.procs"
    # The container's cgroup lists the entry point's pid (what the kernel shows; $$ survives the exec).
    wrapper = f'echo $$ > {shlex.quote(str(procs))}; exec sh {shlex.quote(str(entry))} "$@"'
    result = _run(["sh", "-c", wrapper, "sh", "--node-name", "gpu-node-01"], env=env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    pid = lines[0].removeprefix("pid=")
    assert (fs / own.lstrip("/") / "agent" / "cgroup.procs").read_text().strip() == pid
    assert lines[1:] == ["arg=--node-name", "arg=gpu-node-01", "arg=--cgroup-parent", f"arg={own}/ranks"]
    # A cgroup path that the mounted tree does not hold (a namespace mismatch): refuse, say why.
    procs.write_text("1\n")
    result = _run(["sh", str(entry), "--node-name", "n"], env=env)
    assert result.returncode == 1 and "is not" in result.stderr and "process-group" in result.stderr
    # cgroup v1 (no cgroup.controllers at the root): the agent as it is, its default parent.
    (fs / "cgroup.controllers").unlink()
    result = _run(["sh", str(entry), "--node-name", "n"], env=env)
    assert result.returncode == 0 and result.stdout.splitlines()[1:] == ["arg=--node-name", "arg=n"]


@pytest.mark.slow
def test_grpc_health_probe_script(tmp_path):
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    probe = _write_script(tmp_path, "grpc-health.py")

    def serve(credentials=None):
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        servicer = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = (
            server.add_secure_port("127.0.0.1:0", credentials)
            if credentials
            else server.add_insecure_port("127.0.0.1:0")
        )
        server.start()
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        return server, servicer, port

    server, servicer, port = serve()
    try:
        ok = _run([sys.executable, str(probe), f"127.0.0.1:{port}"])
        assert ok.returncode == 0, ok.stderr
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        down = _run([sys.executable, str(probe), f"127.0.0.1:{port}"])
        assert down.returncode == 1 and "NOT_SERVING" in down.stderr
    finally:
        server.stop(None)
    gone = _run([sys.executable, str(probe), f"127.0.0.1:{port}", "--timeout", "1"])
    assert gone.returncode == 1 and "UNAVAILABLE" in gone.stderr

    from phalanx.cli.certs import generate_local_pki

    pki = generate_local_pki(tmp_path / "tls", hosts=("phalanx-scheduler",))
    credentials = grpc.ssl_server_credentials([(pki.server_key.read_bytes(), pki.server_cert.read_bytes())])
    server, servicer, port = serve(credentials)
    try:
        target = f"127.0.0.1:{port}"
        ok = _run([sys.executable, str(probe), target, "--ca", str(pki.ca), "--server-name", "phalanx-scheduler"])
        assert ok.returncode == 0, ok.stderr
        wrong = _run([sys.executable, str(probe), target, "--ca", str(pki.ca), "--server-name", "elsewhere"])
        assert wrong.returncode == 1
        plain = _run([sys.executable, str(probe), target, "--timeout", "1"])
        assert plain.returncode == 1, "a plaintext probe (Kubernetes' grpc: probe) cannot check a TLS server"
    finally:
        server.stop(None)


@pytest.mark.slow
def test_wait_for_ledger_script(tmp_path):
    wait = _write_script(tmp_path, "wait-for-ledger.py")
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    cmd = [sys.executable, str(wait), "--timeout", "0", "--interval", "0"]
    empty = _run(cmd, env={"PHALANX_DB": url}, cwd=tmp_path)
    assert empty.returncode == 1 and "phalanx-db-upgrade" in empty.stderr, empty.stderr
    upgraded = _run([sys.executable, "-m", "db", "upgrade", "--db", url], cwd=tmp_path)
    assert upgraded.returncode == 0, upgraded.stderr
    ready = _run(cmd, env={"PHALANX_DB": url}, cwd=tmp_path)
    assert ready.returncode == 0 and ready.stdout.startswith("ledger at "), ready.stderr
