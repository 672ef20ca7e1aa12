"""`phalanx web`: a live, read-only dashboard, a client of the scheduler's gRPC API like the CLI.

One process: an HTTP server (the standard library's, one thread per connection) serves the page and its assets
(shipped in the package: nothing is fetched at run time), the cluster's state as JSON (`/api/state`), a job
(`/api/job/ID`, with its goodput split and its rank 0's last log lines), and the state again as server-sent events
(`/api/events`) each time it changes. A `Model` keeps the state: the nodes (ListNodes every `node_poll_s`), the jobs
(a WatchJobs stream of every job the caller may see: a change reaches the page within a poll of the stream), the
queues, and a short history of utilization and goodput. The caller's token decides what it sees: a user its
tenant's jobs, an admin everything.
"""

from __future__ import annotations

import json
import mimetypes
import threading
import time
from collections import deque
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import unquote, urlparse

from phalanx.client import Client, Job, JobState, Node, PhalanxError

STATIC = resources.files("phalanx.web") / "static"
JOB_SYNC_S = 30.0  # how often the poll lists the active jobs besides the watch (and at each reconnect)
HISTORY = 720  # points of utilization/goodput history (at node_poll_s each: an hour at 5 s)


def node_view(n: Node) -> dict[str, Any]:
    return {
        "name": n.name,
        "state": n.state.value,
        "health": n.health,
        "path": list(n.fabric_path),
        "gpus": n.gpus,
        "free": n.free_gpus,
        "releasing": n.releasing_gpus,
        "model": n.gpu_model,
        "fatal": n.fatal_gpus,
        "mig": [g["index"] for g in n.gpu_details if g.get("mig_mode") == "enabled"],
    }


def job_view(j: Job) -> dict[str, Any]:
    return {
        "id": j.id,
        "name": j.name,
        "state": j.state.value,
        "tenant": j.tenant,
        "queue": j.queue,
        "priority": j.priority,
        "message": j.message,
        "attempt": j.attempt,
        "submitted_at": j.submitted_at,
        "started_at": j.started_at,
        "finished_at": j.finished_at,
        "gang": f"{j.replicas}x{j.mig_profile or (str(j.gpu_milli) + 'm' if j.gpu_milli else j.gpus_per_replica)}",
        "allocations": [a.to_dict() for a in j.allocations],
    }


class Model:
    """The dashboard's view of the cluster, kept up to date by two threads; `version` counts its changes."""

    def __init__(
        self, scheduler: str, token: str | None = None, node_poll_s: float = 2.0, checkpoint: str | None = None
    ) -> None:
        self.scheduler, self.token, self.node_poll_s = scheduler, token, node_poll_s
        self.checkpoint = checkpoint  # the checkpoint coordinator, for a job page's checkpoints (None: not shown)
        self.cond = threading.Condition()
        self.version = 0
        self.nodes: list[dict[str, Any]] = []
        self.jobs: dict[str, dict[str, Any]] = {}
        self.queues: list[dict[str, Any]] = []
        self.history: deque[tuple[float, float, float]] = deque(maxlen=HISTORY)  # (t, utilization, goodput)
        self.error = ""
        # When the poll next lists the active jobs: WatchJobs of every job sends changes only, so a (re)connected
        # watch needs a list to catch up from, and a slow re-list covers a change missed between the two.
        self._next_sync = 0.0
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._poll, name="web-poll", daemon=True),
            threading.Thread(target=self._watch, name="web-watch", daemon=True),
        ]

    def client(self) -> Client:
        return Client(self.scheduler, token=self.token, timeout=10.0)

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        with self.cond:
            self.cond.notify_all()

    def _changed(self) -> None:
        with self.cond:
            self.version += 1
            self.cond.notify_all()

    def snapshot(self) -> dict[str, Any]:
        with self.cond:
            return {
                "version": self.version,
                "scheduler": self.scheduler,
                "nodes": self.nodes,
                "jobs": [j for j in self.jobs.values() if j["state"] in ("PENDING", "RUNNING", "PREEMPTING")],
                "queues": self.queues,
                "history": list(self.history),
                "error": self.error,
            }

    def _poll(self) -> None:
        """Nodes, queues, utilization and goodput, every node_poll_s."""
        while not self._stop.is_set():
            try:
                with self.client() as client:
                    nodes = [node_view(n) for n in client.nodes()]
                    queues = [q.to_dict() for q in client.queues()]
                    report = client.goodput(limit=1)
                    jobs = None
                    if time.monotonic() >= self._next_sync:
                        jobs = client.list_jobs(states=["PENDING", "RUNNING"], limit=5000)
                        self._next_sync = time.monotonic() + JOB_SYNC_S
                total = sum(n["gpus"] for n in nodes) or 1
                used = sum(n["gpus"] - n["free"] for n in nodes if n["state"] == "READY")
                ratio = report.cluster.ratio if report.cluster.allocated else 0.0
                with self.cond:
                    moved = nodes != self.nodes or queues != self.queues or bool(self.error)
                    self.nodes, self.queues, self.error = nodes, queues, ""
                    if jobs is not None:  # the watch keeps them current between these
                        for j in jobs:
                            self.jobs.setdefault(j.id, job_view(j))
                        moved = True
                    self.history.append((time.time(), used / total, ratio))
                if moved:
                    self._changed()
            except PhalanxError as exc:
                with self.cond:
                    self.error = str(exc)
                self._changed()
            self._stop.wait(self.node_poll_s)

    def _watch(self) -> None:
        """Every job change, as the scheduler streams it."""
        while not self._stop.is_set():
            try:
                with self.client() as client:
                    self._next_sync = 0.0  # (re)connected: the next poll lists the active jobs
                    for job in client.watch():
                        with self.cond:
                            if job.terminal:
                                self.jobs.pop(job.id, None)
                            else:
                                self.jobs[job.id] = job_view(job)
                        self._changed()
                        if self._stop.is_set():
                            return
            except PhalanxError as exc:
                with self.cond:
                    self.error = f"watching jobs: {exc}"
                self._stop.wait(1.0)

    def job(self, job_id: str) -> dict[str, Any]:
        with self.client() as client:
            j = client.get_job(job_id)
            out = job_view(j)
            out.update(
                spec={
                    "replicas": j.replicas,
                    "gpus_per_replica": j.gpus_per_replica,
                    "command": j.command,
                    "required_tier": j.required_tier,
                    "time_limit": j.time_limit,
                },
                failures=j.failures,
                preemptions=j.preemptions,
                restore=j.restore,
                goodput=j.goodput.to_dict() if j.goodput else None,
                placement=j.placement,
            )
            out["checkpoints"] = self._checkpoints(job_id)
            try:
                out["logs"] = [f"[rank {r}] {line}" for r, line in client.logs(job_id, rank=0, tail=50)]
            except PhalanxError as exc:
                out["logs"] = [f"(no log: {exc})"]
        return out

    def _checkpoints(self, job_id: str) -> list[dict[str, Any]] | str:
        """The job's newest committed checkpoints from the coordinator (a string says why there are none)."""
        if not self.checkpoint:
            return "not shown: phalanx web --checkpoint-coordinator ADDR shows them"
        import grpc

        from phalanx.api.v1 import checkpoint_pb2, checkpoint_pb2_grpc
        from phalanx.client import open_channel

        channel = open_channel(self.checkpoint, token=self.token or "", retries=0)
        try:
            stub = checkpoint_pb2_grpc.CheckpointCoordinatorStub(channel)  # type: ignore[no-untyped-call]
            got = stub.ListCheckpoints(checkpoint_pb2.ListCheckpointsRequest(job_id=job_id, page_size=20), timeout=5)
        except grpc.RpcError as exc:
            return f"the coordinator did not answer: {exc.code().name}"
        finally:
            channel.close()
        return [
            {"step": c.step, "attempt": c.attempt, "committed_at": c.committed_at, "shards": len(c.shards)}
            for c in got.checkpoints
        ]


class _Handler(BaseHTTPRequestHandler):
    model: Model
    server_version = "phalanx-web"

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the dashboard polls
        pass

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def _json(self, doc: Any, status: int = 200) -> None:
        self._send(status, json.dumps(doc).encode(), "application/json")

    def do_GET(self) -> None:
        path = urlparse(self.path).path
        if path in ("/", "/index.html"):
            path = "/index.html"
        if path == "/api/state":
            return self._json(self.model.snapshot())
        if path.startswith("/api/job/"):
            try:
                return self._json(self.model.job(unquote(path[len("/api/job/") :])))
            except PhalanxError as exc:
                return self._json({"error": str(exc)}, HTTPStatus.NOT_FOUND)
        if path == "/api/events":
            return self._events()
        name = path.lstrip("/")
        if "/" in name or not name:
            return self._send(HTTPStatus.NOT_FOUND, b"not found", "text/plain")
        asset = STATIC / name
        if not asset.is_file():
            return self._send(HTTPStatus.NOT_FOUND, b"not found", "text/plain")
        kind = mimetypes.guess_type(name)[0] or "application/octet-stream"
        self._send(HTTPStatus.OK, asset.read_bytes(), kind + ("; charset=utf-8" if kind.startswith("text") else ""))

    def _events(self) -> None:
        """Server-sent events: the state at once, then each time it changes (a comment every 15 s keeps it open)."""
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        seen = -1
        model = self.model
        try:
            while not model._stop.is_set():
                with model.cond:
                    if model.version == seen:
                        model.cond.wait(timeout=15.0)
                    changed = model.version != seen
                if changed:
                    doc = model.snapshot()
                    seen = doc["version"]
                    self.wfile.write(b"event: state\ndata: " + json.dumps(doc).encode() + b"\n\n")
                else:
                    self.wfile.write(b": keepalive\n\n")
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            return


class WebServer:
    """The dashboard on `host`:`port` (0: any free port) for the scheduler at `scheduler`."""

    def __init__(
        self,
        scheduler: str,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        poll_s: float = 2.0,
        checkpoint: str | None = None,
    ) -> None:
        self.model = Model(scheduler, token, poll_s, checkpoint)
        handler = type("Handler", (_Handler,), {"model": self.model})
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://{host}:{self.port}/"
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="web-http", daemon=True)

    def start(self) -> WebServer:
        self.model.start()
        self._thread.start()
        return self

    def stop(self) -> None:
        self.model.stop()
        self.httpd.shutdown()
        self.httpd.server_close()


__all__ = ["WebServer", "Model", "JobState"]
