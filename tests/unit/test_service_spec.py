"""The service spec file of `phalanx apply -f` and its published JSON Schema (phalanx/schemas/service.schema.json):
good files load, bad ones list every problem with its place in the file, unknown fields are errors, the schema agrees
with the scheduler's own limits, and a spec survives the round trip file -> ServiceSpec -> proto -> file."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from phalanx.api.v1 import service_pb2
from phalanx.client import (
    Autoscale,
    ReadyProbe,
    Role,
    Service,
    ServiceSpec,
    ServiceSpecError,
    load_service_spec,
    parse_service_spec,
    service_schema,
    service_spec_problems,
)
from phalanx.core.preemption import PRIORITY_CLASSES
from services.scheduler.serving.spec import MAX_SERVICE_REPLICAS
from services.scheduler.serving_fields import MAX_ROLES, NAME, START_ORDERS

GOOD = """\
name: llm
replicas: 2
nodes_per_replica: 2
gpus_per_node: 8
command: vllm serve meta-llama/Llama-3.1-70B-Instruct --tensor-parallel-size 8 --pipeline-parallel-size 2
env: {HF_HOME: /models, VLLM_PORT: 8000}
priority: high
start_order: leader-first
ready_probe: {http_port: 8000, http_path: /health, period_s: 2, failure_threshold: 3}
spread_tier: leaf
max_surge: 1
max_unavailable: 0
memory_per_node: 512G
autoscale:
  min_replicas: 2
  max_replicas: 6
  metric: vllm:num_requests_waiting
  target: 10
  metrics_port: 8000
"""


def test_a_good_yaml_file_loads(tmp_path):
    path = tmp_path / "llm.yaml"
    path.write_text(GOOD)
    spec = load_service_spec(path)
    assert (spec.name, spec.replicas, spec.nodes, spec.gpus_per_node) == ("llm", 2, 2, 8)
    assert spec.command[:2] == ["vllm", "serve"] and spec.priority == 100
    assert spec.env == {"HF_HOME": "/models", "VLLM_PORT": "8000"}  # a number becomes a string
    assert spec.ready_probe == ReadyProbe(http_port=8000, http_path="/health", period_s=2, failure_threshold=3)
    assert spec.autoscale == Autoscale(2, 6, "vllm:num_requests_waiting", 10, metrics_port=8000)
    msg = spec.to_proto()
    assert (msg.template.replicas, msg.template.gpus_per_replica, msg.template.start_order) == (2, 8, "leader-first")
    assert msg.HasField("max_unavailable") and msg.max_unavailable == 0 and msg.max_surge == 1
    assert msg.template.memory_per_replica == "512G" and msg.template.restart == "always"


def test_json_files_and_text_load_too(tmp_path):
    path = tmp_path / "llm.json"
    path.write_text(json.dumps({"name": "llm", "replicas": 1, "gpus_per_node": 1, "command": ["run"]}))
    assert load_service_spec(path).command == ["run"]
    assert load_service_spec("inline", text="{name: a, replicas: 1, gpus_per_node: 1, command: run}").name == "a"


@pytest.mark.parametrize(
    "doc_change, problem",
    [
        ({"replicas": 0}, "replicas: 0 is less than the minimum of 1"),
        ({"color": "blue"}, "(top level): unknown field 'color'"),
        ({"roles": [{"name": "prefill", "nodes": 1, "cmd": "x"}]}, "roles[0]: unknown field 'cmd'"),
        ({"roles": [{"name": "Prefill", "nodes": 1}]}, "roles[0].name: 'Prefill' does not match"),
        ({"roles": [{"name": "a", "nodes": 1}, {"name": "a", "nodes": 1}]}, "roles: role names must be unique"),
        ({"roles": [{"name": "a", "nodes": 1}], "nodes_per_replica": 2}, "nodes_per_replica: 2, but the roles have"),
        ({"ready_probe": {"command": "true", "http_port": 80}}, "ready_probe: "),
        ({"ready_probe": {"period_s": 1}}, "exactly one of the two"),
        ({"ready_probe": {"http_port": 80, "http_path": "health"}}, "ready_probe.http_path: 'health' does not match"),
        ({"priority": "urgent"}, "priority: 'urgent' is not valid: An integer (higher wins) or a class name"),
        ({"command": []}, "command: [] is not valid"),
        ({"restart": "sometimes"}, "restart: 'sometimes' is not one of"),
        ({"autoscale": {"min_replicas": 1, "max_replicas": 2, "metric": "m"}}, "autoscale: missing required field"),
        ({"autoscale": {"min_replicas": 3, "max_replicas": 2, "metric": "m", "target": 1}}, "is below min_replicas"),
        ({"autoscale": {"min_replicas": 1, "max_replicas": 2, "metric": "m", "target": 0}}, "autoscale.target: 0"),
        ({"max_unavailable": 0}, "a rolling update could never start"),
        ({"memory_per_node": "lots"}, "memory_per_node: memory size 'lots' is not a size"),
        ({"env": {"BAD-NAME": "x"}}, "env: 'BAD-NAME' does not match"),
    ],
)
def test_each_bad_field_is_named(doc_change, problem):
    doc = {"name": "llm", "replicas": 1, "gpus_per_node": 8, "command": "run", **doc_change}
    problems = service_spec_problems(doc)
    assert any(problem in p for p in problems), problems
    with pytest.raises(ServiceSpecError) as err:
        parse_service_spec(doc, "llm.yaml")
    assert str(err.value).startswith("llm.yaml: ") and err.value.problems == problems


def test_every_problem_of_a_file_is_listed_at_once(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: Bad_Name\nreplicas: 0\nnodes: 2\ncommand: run\n")
    with pytest.raises(ServiceSpecError) as err:
        load_service_spec(path)
    problems = err.value.problems
    assert any(p.startswith("(top level): missing required field 'gpus_per_node'") for p in problems), problems
    assert any(p.startswith("(top level): unknown field 'nodes'") for p in problems), problems
    assert any(p.startswith("name: 'Bad_Name' does not match") for p in problems), problems
    assert any(p.startswith("replicas: 0 is less than") for p in problems), problems


@pytest.mark.parametrize(
    "text, problem",
    [
        ("name: [unclosed\n", "line 2 column 1: not YAML"),
        ("- a\n- b\n", "(top level): ['a', 'b'] is not of type 'object'"),
        ("name: a\n---\nname: b\n", "one document, this one holds 2"),
    ],
)
def test_a_file_that_is_not_one_yaml_mapping(text, problem):
    with pytest.raises(ServiceSpecError) as err:
        load_service_spec("x.yaml", text=text)
    assert any(problem in p for p in err.value.problems), err.value.problems


def test_an_unreadable_file_is_a_spec_error(tmp_path):
    with pytest.raises(ServiceSpecError, match="cannot read it"):
        load_service_spec(tmp_path / "missing.yaml")


def test_the_schema_agrees_with_the_scheduler():
    schema = service_schema()
    props, defs = schema["properties"], schema["$defs"]
    assert schema["additionalProperties"] is False and defs["role"]["additionalProperties"] is False
    assert props["priority"]["oneOf"][1]["enum"] == list(PRIORITY_CLASSES)
    assert (
        props["replicas"]["maximum"]
        == MAX_SERVICE_REPLICAS
        == defs["autoscale"]["properties"]["max_replicas"]["maximum"]
    )
    assert set(props["start_order"]["enum"]) == set(START_ORDERS) - {""}
    assert props["roles"]["maxItems"] == MAX_ROLES
    pattern = re.compile(props["name"]["pattern"])
    for name in ("a", "llm-0", "a" * 63, "A", "-a", "a-", "a" * 64, "a_b", ""):
        assert bool(pattern.search(name)) == bool(NAME.match(name)), name


def test_a_spec_survives_file_to_proto_and_back():
    spec = parse_service_spec(yaml.safe_load(GOOD))
    again = ServiceSpec.from_proto(spec.to_proto())
    assert again.to_dict() == spec.to_dict()
    assert parse_service_spec(spec.to_dict()) == spec
    roles = ServiceSpec(
        "pd",
        1,
        gpus_per_node=8,
        command=["serve"],
        roles=[Role("prefill", 2, ["prefill"]), Role("decode", 1, env={"X": "1"})],
        restart="none",
        ready_probe=ReadyProbe(command=["curl", "-f", "localhost:8000/health"]),
    )
    msg = roles.to_proto()
    assert msg.template.replicas == 0 and msg.template.restart == "never"  # 0: the scheduler adds the roles up
    assert [(r.name, r.replicas, list(r.command)) for r in msg.template.roles] == [
        ("prefill", 2, ["prefill"]),
        ("decode", 1, []),
    ]
    assert parse_service_spec(roles.to_dict()).roles == roles.roles


def test_the_service_json_shape():
    msg = service_pb2.Service(revision=2, ready_replicas=1, message="rolling out")
    msg.spec.CopyFrom(ServiceSpec("llm", 2, 2, 8, ["run"], port=8000).to_proto())
    msg.replicas.add(index=0, revision=2, state="READY", ready=True, nodes=["n0", "n1"], leader_address="h0:8000")
    msg.replicas.add(index=1, revision=1, state="STARTING", nodes=["n2", "n3"], leader_address="h2:8000")
    doc = Service.from_proto(msg).to_dict()
    assert {"name", "revision", "replicas"} <= set(doc) and (doc["name"], doc["revision"]) == ("llm", 2)
    assert doc["replicas"][0] == {
        "index": 0,
        "revision": 2,
        "state": "READY",
        "ready": True,
        "nodes": ["n0", "n1"],
        "leader_address": "h0:8000",
        "job_id": "",
        "message": "",
        "surge": False,
    }
    assert [e.to_dict() for e in Service.from_proto(msg).endpoints] == [
        {"replica": 0, "address": "h0:8000", "revision": 2}
    ]
    assert service_spec_problems(doc["spec"]) == []  # `service get --json | jq .spec` is a spec file
