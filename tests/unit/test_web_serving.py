"""The dashboard's JSON for serving fleets (phalanx.web.serving): a service and its replicas as the page draws them,
the replica each job is, and how ListServices' failures reach the model."""

from __future__ import annotations

import grpc
import pytest

from phalanx.api.v1 import common_pb2, service_pb2
from phalanx.client import NotFoundError, PermissionDeniedError, RPCError, UnauthenticatedError
from phalanx.web import serving


def a_service(name: str = "chat", tenant: str = "alice") -> service_pb2.Service:
    template = common_pb2.JobSpec(replicas=2, gpus_per_replica=8, command=["serve"])
    spec = service_pb2.ServiceSpec(name=name, replicas=3, template=template, port=8000)
    spec.autoscale.CopyFrom(service_pb2.Autoscale(min_replicas=1, max_replicas=6, metric="waiting", target=4.0))
    s = service_pb2.Service(
        spec=spec,
        revision=2,
        ready_replicas=1,
        message="rolling out revision 2: 1 of 3 replicas updated",
        tenant=tenant,
        created_at=1700000000.0,
        autoscaler="scale 2 -> 3: waiting 13.0 per replica over target 4",
    )
    s.replicas.add(
        index=0,
        revision=2,
        state="READY",
        ready=True,
        nodes=["node-0", "node-1"],
        leader_address="10.0.0.1:8000",
        job_id="aaaaaaaaaaaa",
    )
    s.replicas.add(index=1, revision=1, state="STARTING", nodes=["node-2", "node-3"], job_id="bbbbbbbbbbbb")
    s.replicas.add(
        index=2, revision=2, state="PENDING", job_id="cccccccccccc", message="waiting for 16 GPUs", surge=True
    )
    return s


def test_a_service_is_shown_with_its_revision_readiness_decision_and_replicas():
    view = serving.service_view(a_service())
    assert {k: v for k, v in view.items() if k != "replicas"} == {
        "name": "chat",
        "tenant": "alice",
        "revision": 2,
        "desired": 3,
        "ready": 1,
        "message": "rolling out revision 2: 1 of 3 replicas updated",
        "autoscaler": "scale 2 -> 3: waiting 13.0 per replica over target 4",
        "autoscale": {"min": 1, "max": 6, "metric": "waiting", "target": 4.0},
        "gang": "2x8",
        "created_at": 1700000000.0,
    }
    assert view["replicas"][0] == {
        "index": 0,
        "revision": 2,
        "state": "READY",
        "ready": True,
        "nodes": ["node-0", "node-1"],
        "leader": "10.0.0.1:8000",
        "job_id": "aaaaaaaaaaaa",
        "message": "",
        "surge": False,
    }
    assert [(r["index"], r["state"], r["ready"], r["surge"]) for r in view["replicas"]] == [
        (0, "READY", True, False),
        (1, "STARTING", False, False),
        (2, "PENDING", False, True),
    ]
    assert view["replicas"][2]["message"] == "waiting for 16 GPUs" and view["replicas"][2]["leader"] == ""


def test_a_service_without_an_autoscaler_says_none():
    s = a_service()
    s.spec.ClearField("autoscale")
    s.autoscaler = ""
    view = serving.service_view(s)
    assert view["autoscale"] is None and view["autoscaler"] == ""


def test_each_replica_job_knows_its_service_and_the_others_stay_as_they_are():
    services = [serving.service_view(a_service())]
    index = serving.replica_index(services)
    assert index == {
        "aaaaaaaaaaaa": {"service": "chat", "replica": 0, "revision": 2, "ready": True, "state": "READY"},
        "bbbbbbbbbbbb": {"service": "chat", "replica": 1, "revision": 1, "ready": False, "state": "STARTING"},
        "cccccccccccc": {"service": "chat", "replica": 2, "revision": 2, "ready": False, "state": "PENDING"},
    }
    plain = {"id": "dddddddddddd", "name": "train", "service": None}
    replica = {"id": "aaaaaaaaaaaa", "name": "chat-0", "service": None}
    out = serving.with_services([plain, replica], index)
    assert out[0] is plain  # untouched
    assert out[1] == {"id": "aaaaaaaaaaaa", "name": "chat-0", "service": index["aaaaaaaaaaaa"]}
    assert replica["service"] is None  # the model's own entry is not changed by a snapshot


class _RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _Channel:
    """What the generated stub asks of a channel: a callable per method, answering `answer` (or raising it)."""

    def __init__(self, answer: object) -> None:
        self.answer = answer
        self.calls: list[tuple[str, object, float | None]] = []

    def unary_unary(self, method: str, *args: object, **kwargs: object):
        def call(request: object, timeout: float | None = None, **_: object) -> object:
            self.calls.append((method, request, timeout))
            if isinstance(self.answer, Exception):
                raise self.answer
            return self.answer

        return call

    unary_stream = stream_unary = stream_stream = unary_unary


class _Client:
    def __init__(self, answer: object) -> None:
        self._channel = _Channel(answer)


def test_services_are_listed_on_the_clients_channel_sorted_by_tenant_and_name():
    listed = service_pb2.ListServicesResponse(
        services=[a_service("zeta", "alice"), a_service("alpha", "bob"), a_service("beta", "alice")]
    )
    client = _Client(listed)
    got = serving.list_services(client)  # type: ignore[arg-type]
    assert [(s["tenant"], s["name"]) for s in got] == [("alice", "beta"), ("alice", "zeta"), ("bob", "alpha")]
    [(method, _, timeout)] = client._channel.calls
    assert method == "/phalanx.v1.ServiceService/ListServices" and timeout == serving.LIST_TIMEOUT_S


def test_a_scheduler_without_services_is_none_and_refusals_are_the_sdks_errors():
    assert serving.list_services(_Client(_RpcError(grpc.StatusCode.UNIMPLEMENTED, "no such service"))) is None
    for code, kind in (
        (grpc.StatusCode.UNAUTHENTICATED, UnauthenticatedError),  # the model ends the token's sessions on these
        (grpc.StatusCode.PERMISSION_DENIED, PermissionDeniedError),
        (grpc.StatusCode.NOT_FOUND, NotFoundError),
        (grpc.StatusCode.UNAVAILABLE, RPCError),
    ):
        with pytest.raises(kind) as err:
            serving.list_services(_Client(_RpcError(code, "refused: why")))  # type: ignore[arg-type]
        assert err.value.code == code and err.value.message == "refused: why"
