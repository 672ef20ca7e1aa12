"""`phalanx web`: a live, read-only dashboard, a client of the scheduler's gRPC API like the CLI.

One process: an HTTP server (the standard library's, one thread per connection) serves the page and its assets
(shipped in the package: nothing is fetched at run time), the cluster's state as JSON (`/api/state`), a job
(`/api/job/ID`, with its goodput split; then its checkpoints and its rank 0's last log lines, apart:
phalanx.web.jobpage), and the state again as server-sent events (`/api/events`) each time it changes. The state
holds the serving fleets too (phalanx.web.serving): each service with its replicas and their readiness, and each
job that is a replica says which.

The dashboard holds no credential of its own. A visitor signs in (`/login`) with their own Phalanx token, which the
server checks with a call to the scheduler made with it; the session is a random id in an HttpOnly, SameSite=Strict
cookie (Secure, and __Host-, over TLS) that names, server-side, the token, an expiry and a CSRF token that every
state-changing request (sign-out) must carry in the X-CSRF-Token header; the sign-in form itself is accepted only
from the dashboard's own origin. Every data request goes to the scheduler with the visitor's token, so a user sees
its tenant's jobs and services, an admin everything: a `Model` per distinct token keeps that token's view, the nodes
and the services (ListNodes and ListServices every `node_poll_s`), the jobs (a WatchJobs stream of every job the
token may see), the queues, and a short history of utilization and goodput, and stops with the last session using
it. A token the scheduler stops accepting ends its sessions at their next request.

It serves 127.0.0.1 by default; beyond loopback only over TLS (a certificate and key) or when told `insecure`.
Every response carries a strict Content-Security-Policy (scripts, styles and connections from the dashboard only,
no inline script or style, no framing), X-Content-Type-Options: nosniff and Referrer-Policy: no-referrer; the page
draws every value with DOM text nodes, never as markup.
"""

from __future__ import annotations

import hmac
import html
import ipaddress
import json
import mimetypes
import secrets
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from http.cookies import CookieError, SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

from phalanx.client import (
    Client,
    Job,
    JobState,
    Node,
    NotFoundError,
    PermissionDeniedError,
    PhalanxError,
    UnauthenticatedError,
)
from phalanx.web.jobpage import checkpoints, job_detail, log_tail
from phalanx.web.serving import list_services, replica_index, with_services

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
        "service": None,  # a replica's: its service, index, revision and readiness (the snapshot joins them)
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
        self.services: list[dict[str, Any]] | None = []  # None: the scheduler has no ServiceService
        self.replicas: dict[str, dict[str, Any]] = {}  # job id -> its place in its service (serving.replica_index)
        self.history: deque[tuple[float, float, float]] = deque(maxlen=HISTORY)  # (t, utilization, goodput)
        self.error = ""
        self.refused = ""  # non-empty: the scheduler refused the token (its sessions are over), and why
        # When the poll next lists the active jobs: WatchJobs of every job sends changes only, so a (re)connected
        # watch needs a list to catch up from, and a slow re-list covers a change missed between the two.
        self._next_sync = 0.0
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._poll, name="web-poll", daemon=True),
            threading.Thread(target=self._watch, name="web-watch", daemon=True),
        ]

    def client(self) -> Client:
        # token "" (never None, which would fall back to this process's $PHALANX_TOKEN): the visitor's own only
        return Client(self.scheduler, token=self.token or "", timeout=10.0)

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
            active = [j for j in self.jobs.values() if j["state"] in ("PENDING", "RUNNING", "PREEMPTING")]
            return {
                "version": self.version,
                "scheduler": self.scheduler,
                "nodes": self.nodes,
                "jobs": with_services(active, self.replicas),
                "queues": self.queues,
                "services": self.services or [],
                "serving": self.services is not None,
                "history": list(self.history),
                "error": self.error,
            }

    def _poll(self) -> None:
        """Nodes, queues, services, utilization and goodput, every node_poll_s."""
        while not self._stop.is_set():
            try:
                with self.client() as client:
                    nodes = [node_view(n) for n in client.nodes()]
                    queues = [q.to_dict() for q in client.queues()]
                    services = list_services(client)
                    report = client.goodput(limit=1)
                    jobs = None
                    if time.monotonic() >= self._next_sync:
                        jobs = client.list_jobs(states=["PENDING", "RUNNING"], limit=5000)
                        self._next_sync = time.monotonic() + JOB_SYNC_S
                total = sum(n["gpus"] for n in nodes) or 1
                used = sum(n["gpus"] - n["free"] for n in nodes if n["state"] == "READY")
                ratio = report.cluster.ratio if report.cluster.allocated else 0.0
                with self.cond:
                    moved = (
                        nodes != self.nodes or queues != self.queues or services != self.services or bool(self.error)
                    )
                    self.nodes, self.queues, self.error = nodes, queues, ""
                    self.services, self.replicas = services, replica_index(services or [])
                    if jobs is not None:  # the watch keeps them current between these
                        for j in jobs:
                            self.jobs.setdefault(j.id, job_view(j))
                        moved = True
                    self.history.append((time.time(), used / total, ratio))
                if moved:
                    self._changed()
            except (UnauthenticatedError, PermissionDeniedError) as exc:
                self._refused(exc)
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
            except (UnauthenticatedError, PermissionDeniedError) as exc:
                self._refused(exc)
            except PhalanxError as exc:
                with self.cond:
                    self.error = f"watching jobs: {exc}"
                self._stop.wait(1.0)

    def _refused(self, exc: PhalanxError) -> None:
        """The scheduler no longer accepts this model's token (removed, rotated): its sessions end at their next
        request, and the model stops."""
        with self.cond:
            self.refused = f"the scheduler no longer accepts this token: {exc}"
        self.stop()

    # A job's page, in three parts (phalanx.web.jobpage): the job at once, its checkpoints and log tail after. Each
    # part asks the scheduler for the job with the visitor's token first: another tenant's job is NotFoundError in
    # every part, as it is for the job itself.

    def job(self, job_id: str) -> dict[str, Any]:
        with self.client() as client:
            j = client.get_job(job_id)
        out = job_detail(j, job_view(j))
        with self.cond:
            out["service"] = self.replicas.get(j.id)
        return out

    def job_checkpoints(self, job_id: str) -> dict[str, Any]:
        with self.client() as client:
            client.get_job(job_id)
        return {"checkpoints": checkpoints(self.checkpoint, self.token or "", job_id)}

    def job_logs(self, job_id: str) -> dict[str, Any]:
        with self.client() as client:
            client.get_job(job_id)
            return {"logs": log_tail(client, job_id)}


# ---- sessions ----------------------------------------------------------------------------------------------------
# A visitor signs in with their own Phalanx token (POST /login, checked by a call to the scheduler with it). The
# server keeps the session: a random id (the cookie's only content), the token, a CSRF token and an expiry. The
# dashboard holds no credential of its own: each visitor's data comes from a Model that calls the scheduler with
# that visitor's token (one per distinct token, shared by its sessions, stopped with the last of them).

SESSION_TTL_S = 8 * 3600.0
MAX_SESSIONS = 10_000  # past this many, a sign-in ends the oldest session
MAX_FORM_BYTES = 8192  # a sign-in form: a token, nothing more
SIGN_IN_FAILURE_DELAY_S = 0.5  # a refused sign-in holds the sign-in lock this long: guesses go one at a time
CSRF_HEADER = "X-CSRF-Token"
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
SECURITY_HEADERS = (
    ("Content-Security-Policy", CSP),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
    ("X-Frame-Options", "DENY"),
    ("Cache-Control", "no-store"),
)

HSTS = "max-age=31536000"  # a year; no includeSubDomains: the dashboard does not speak for its domain's other hosts


@dataclass
class Session:
    sid: str
    token: str
    csrf: str
    expires: float  # time.time()
    model: Model


class Sessions:
    """Signed-in visitors by session id, and the Models their tokens feed (one per token, counted by session)."""

    def __init__(
        self,
        scheduler: str,
        poll_s: float,
        checkpoint: str | None,
        ttl_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.scheduler, self.poll_s, self.checkpoint, self.ttl_s = scheduler, poll_s, checkpoint, ttl_s
        self.clock = clock  # wall seconds: when sessions expire (a test moves its own)
        self.lock = threading.Lock()
        self.sign_in_lock = threading.Lock()
        self.by_id: dict[str, Session] = {}
        self.models: dict[str, tuple[Model, int]] = {}  # token -> (model, sessions using it)
        self.stopped = threading.Event()
        # Sessions end at their expiry even when nobody calls (their models stop polling the scheduler).
        self._sweeper = threading.Thread(target=self._sweep_every_second, name="web-sessions", daemon=True)

    def start(self) -> None:
        self._sweeper.start()

    def _sweep_every_second(self) -> None:
        while not self.stopped.wait(1.0):
            with self.lock:
                self._sweep(self.clock())

    def verify(self, token: str) -> None:
        """Raise PhalanxError unless the scheduler accepts `token` for the job API (a cheap call made with it)."""
        # The client's retries of UNAVAILABLE: a read, safe to repeat, and a fresh channel's first connection may
        # fail on a loaded host (a sign-in must not fail on that). A wrong token is refused at once, not retried.
        with Client(self.scheduler, token=token, timeout=10.0) as client:  # "": no credential
            client.list_jobs(limit=1)

    def create(self, token: str) -> Session:
        now = self.clock()
        with self.lock:
            self._sweep(now)
            while len(self.by_id) >= MAX_SESSIONS:
                self._end(min(self.by_id.values(), key=lambda s: s.expires))
            model, users = self.models.get(token, (None, 0))
            if model is None or model.refused:
                model = Model(self.scheduler, token, self.poll_s, self.checkpoint)
                model.start()
                users = 0
            self.models[token] = (model, users + 1)
            session = Session(secrets.token_urlsafe(32), token, secrets.token_urlsafe(32), now + self.ttl_s, model)
            self.by_id[session.sid] = session
            return session

    def get(self, sid: str | None) -> Session | None:
        """The live session `sid` names; None for no session, an unknown id, an expired one, or one whose token the
        scheduler no longer accepts (both ended here)."""
        if not sid:
            return None
        now = self.clock()
        with self.lock:
            self._sweep(now)
            return self.by_id.get(sid)

    def end(self, session: Session) -> None:
        with self.lock:
            self._end(session)

    def _sweep(self, now: float) -> None:
        for session in [s for s in self.by_id.values() if s.expires <= now or s.model.refused]:
            self._end(session)

    def _end(self, session: Session) -> None:
        if self.by_id.pop(session.sid, None) is None:
            return
        model, users = self.models.get(session.token, (None, 0))
        if model is not session.model:
            session.model.stop()  # replaced after a refusal
            return
        if users <= 1:
            del self.models[session.token]
            model.stop()
        else:
            self.models[session.token] = (model, users - 1)

    def stop(self) -> None:
        self.stopped.set()
        with self.lock:
            for session in list(self.by_id.values()):
                self._end(session)
            for model, _ in self.models.values():
                model.stop()
            self.models.clear()


def _login_page(message: str = "") -> bytes:
    page = (STATIC / "login.html").read_text()
    note = f'<p class="error" role="alert">{html.escape(message)}</p>' if message else ""
    return page.replace("<!--message-->", note).encode()


class _Handler(BaseHTTPRequestHandler):
    sessions: Sessions
    tls: bool
    server_version = "phalanx-web"
    timeout = 60  # seconds a connection may sit idle mid-request (the event stream writes every 15 s)

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the dashboard polls
        pass

    def end_headers(self) -> None:  # every response, errors included
        for name, value in SECURITY_HEADERS:
            self.send_header(name, value)
        if self.tls:  # a browser that has seen the dashboard over HTTPS never tries it over plain HTTP again
            self.send_header("Strict-Transport-Security", HSTS)
        super().end_headers()

    @property
    def cookie_name(self) -> str:
        # __Host-: the browser keeps it only from a secure origin, for this host and path / (no subdomain may set it)
        return "__Host-phalanx-session" if self.tls else "phalanx-session"

    def _send(self, status: int, body: bytes, content_type: str, headers: tuple[tuple[str, str], ...] = ()) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, doc: Any, status: int = 200, headers: tuple[tuple[str, str], ...] = ()) -> None:
        self._send(status, json.dumps(doc).encode(), "application/json", headers)

    def _redirect(self, to: str, headers: tuple[tuple[str, str], ...] = ()) -> None:
        self._send(HTTPStatus.SEE_OTHER, b"", "text/plain", (("Location", to), *headers))

    def _cookie(self, value: str, max_age: int) -> tuple[str, str]:
        jar: SimpleCookie = SimpleCookie()
        jar[self.cookie_name] = value
        morsel = jar[self.cookie_name]
        morsel.update({"path": "/", "samesite": "Strict", "max-age": str(max_age)})
        morsel["httponly"] = True
        if self.tls:
            morsel["secure"] = True
        return ("Set-Cookie", morsel.OutputString())

    def _session(self) -> Session | None:
        raw = self.headers.get("Cookie")
        if not raw:
            return None
        try:
            jar: SimpleCookie = SimpleCookie(raw)
        except CookieError:
            return None
        morsel = jar.get(self.cookie_name)
        return self.sessions.get(morsel.value if morsel else None)

    def _same_origin(self) -> bool:
        """The request comes from a page of this dashboard. Browsers say where a request comes from in
        Sec-Fetch-Site (what is checked when sent: "same-origin" only); one that does not send it must send an
        Origin naming the host the request was sent to (with Referrer-Policy: no-referrer a browser's form post
        says Origin: null, so Sec-Fetch-Site is what a browser is judged by). Neither: refused."""
        site = self.headers.get("Sec-Fetch-Site")
        if site is not None:
            return site == "same-origin"
        origin, host = self.headers.get("Origin"), self.headers.get("Host")
        if not origin or not host or origin == "null":
            return False
        return urlparse(origin).netloc.lower() == host.lower()

    def _unauthorized(self) -> None:
        self._json(
            {"error": "not signed in, or the session has ended: sign in at /login"},
            HTTPStatus.UNAUTHORIZED,
            (self._cookie("", 0),),
        )

    # ---- GET ----

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        path = urlparse(self.path).path
        if path == "/login":
            return self._send(HTTPStatus.OK, _login_page(), "text/html; charset=utf-8")
        if path in ("/", "/index.html"):
            if self._session() is None:
                return self._redirect("/login")
            return self._asset("index.html")
        if path.startswith("/api/"):
            session = self._session()
            if session is None:
                return self._unauthorized()
            return self._api(session, path)
        return self._asset(path.lstrip("/"))

    def _asset(self, name: str) -> None:
        """A file of the page (no data in any: they are served to anyone)."""
        if "/" in name or not name or name == "login.html":
            return self._send(HTTPStatus.NOT_FOUND, b"not found", "text/plain")
        asset = STATIC / name
        if not asset.is_file():
            return self._send(HTTPStatus.NOT_FOUND, b"not found", "text/plain")
        kind = mimetypes.guess_type(name)[0] or "application/octet-stream"
        self._send(HTTPStatus.OK, asset.read_bytes(), kind + ("; charset=utf-8" if kind.startswith("text") else ""))

    def _api(self, session: Session, path: str) -> None:
        if path == "/api/session":
            return self._json({"csrf": session.csrf, "expires": session.expires})
        if path == "/api/state":
            return self._json(session.model.snapshot())
        if path.startswith("/api/job/"):
            # /api/job/ID, /api/job/ID/checkpoints, /api/job/ID/logs (split before unquoting: an id is one segment)
            job_id, _, part = path[len("/api/job/") :].partition("/")
            fetch = {
                "": session.model.job,
                "checkpoints": session.model.job_checkpoints,
                "logs": session.model.job_logs,
            }.get(part)
            if fetch is None or not job_id:
                return self._json({"error": f"no such endpoint {path[:80]!r}"}, HTTPStatus.NOT_FOUND)
            try:
                return self._json(fetch(unquote(job_id)))
            except (UnauthenticatedError, PermissionDeniedError) as exc:
                session.model._refused(exc)
                self.sessions.end(session)
                return self._unauthorized()
            except NotFoundError as exc:
                return self._json({"error": str(exc)}, HTTPStatus.NOT_FOUND)
            except PhalanxError as exc:
                return self._json({"error": str(exc)}, HTTPStatus.BAD_GATEWAY)
        if path == "/api/events":
            return self._events(session)
        return self._json({"error": f"no such endpoint {path[:80]!r}"}, HTTPStatus.NOT_FOUND)

    def _events(self, session: Session) -> None:
        """Server-sent events: the state at once, then each time it changes (a comment every 15 s keeps it open).
        The stream ends with the session."""
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        seen = -1
        model = session.model
        try:
            while not model._stop.is_set() and self.sessions.get(session.sid) is session:
                with model.cond:
                    if model.version == seen:
                        model.cond.wait(timeout=15.0)
                    changed = model.version != seen
                if self.sessions.get(session.sid) is not session:
                    break
                if changed:
                    doc = model.snapshot()
                    seen = doc["version"]
                    self.wfile.write(b"event: state\ndata: " + json.dumps(doc).encode() + b"\n\n")
                else:
                    self.wfile.write(b": keepalive\n\n")
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            return

    # ---- POST ----

    def do_POST(self) -> None:
        path = urlparse(self.path).path
        if path == "/login":
            return self._sign_in()
        if path == "/logout":
            return self._sign_out()
        self._json({"error": f"no such endpoint {path[:80]!r}"}, HTTPStatus.NOT_FOUND)

    def _sign_in(self) -> None:
        if not self._same_origin():
            return self._send(
                HTTPStatus.FORBIDDEN,
                _login_page(
                    "Refused: a sign-in must come from this dashboard's own page (its Sec-Fetch-Site or Origin header)."
                ),
                "text/html; charset=utf-8",
            )
        try:
            length = int(self.headers.get("Content-Length") or "0")
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_FORM_BYTES:
            page = _login_page("Refused: a malformed sign-in form.")
            return self._send(HTTPStatus.BAD_REQUEST, page, "text/html; charset=utf-8")
        form = parse_qs(self.rfile.read(length).decode("utf-8", "replace"), keep_blank_values=True)
        token = (form.get("token") or [""])[0].strip()
        with self.sessions.sign_in_lock:
            try:
                self.sessions.verify(token)
            except (UnauthenticatedError, PermissionDeniedError) as exc:
                time.sleep(SIGN_IN_FAILURE_DELAY_S)
                why = "unknown" if isinstance(exc, UnauthenticatedError) else "not allowed the job API"
                return self._send(
                    HTTPStatus.UNAUTHORIZED,
                    _login_page(f"The scheduler refused this token ({why}): sign in with your own Phalanx token."),
                    "text/html; charset=utf-8",
                )
            except PhalanxError as exc:
                return self._send(
                    HTTPStatus.BAD_GATEWAY,
                    _login_page(f"The scheduler at {self.sessions.scheduler} did not answer: {exc}"),
                    "text/html; charset=utf-8",
                )
        session = self.sessions.create(token)
        self._redirect("/", (self._cookie(session.sid, int(self.sessions.ttl_s)),))

    def _sign_out(self) -> None:
        session = self._session()
        if session is None:
            return self._unauthorized()
        sent = self.headers.get(CSRF_HEADER) or ""
        if not hmac.compare_digest(sent.encode(), session.csrf.encode()):
            return self._json(
                {"error": f"refused: a missing or wrong {CSRF_HEADER} header (the page sends it)"}, HTTPStatus.FORBIDDEN
            )
        self.sessions.end(session)
        self._json({"signed_out": True}, headers=(self._cookie("", 0),))

    def _not_allowed(self) -> None:
        self._json({"error": f"method {self.command} not allowed"}, HTTPStatus.METHOD_NOT_ALLOWED)

    do_PUT = do_DELETE = do_PATCH = _not_allowed


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client gone mid-reply, a failed TLS handshake: nothing to report


def is_loopback(host: str) -> bool:
    """Every address `host` resolves to is a loopback one (127.0.0.0/8, ::1)."""
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos)


class InsecureBind(ValueError):
    """Serving beyond loopback without TLS, unasked."""


class WebServer:
    """The dashboard on `host`:`port` (0: any free port) for the scheduler at `scheduler`.

    Visitors sign in with their own tokens; the server holds none. Beyond loopback it serves HTTPS (`tls_cert`,
    `tls_key`), or plain HTTP only with `insecure=True` (behind a TLS-terminating proxy); else InsecureBind.
    """

    def __init__(
        self,
        scheduler: str,
        host: str = "127.0.0.1",
        port: int = 0,
        poll_s: float = 2.0,
        checkpoint: str | None = None,
        *,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        insecure: bool = False,
        session_ttl_s: float = SESSION_TTL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if bool(tls_cert) != bool(tls_key):
            raise InsecureBind("TLS needs both a certificate (--tls-cert) and its key (--tls-key)")
        tls = bool(tls_cert)
        if not tls and not insecure and not is_loopback(host):
            raise InsecureBind(
                f"refusing to serve the dashboard on {host} over plain HTTP: visitors' tokens and session cookies "
                "would cross the network in clear. Give --tls-cert and --tls-key, or --insecure (behind a proxy that "
                "terminates TLS), or serve on 127.0.0.1"
            )
        self.sessions = Sessions(scheduler, poll_s, checkpoint, session_ttl_s, clock)
        handler = type("Handler", (_Handler,), {"sessions": self.sessions, "tls": tls})
        self.httpd = _Server((host, port), handler)
        if tls:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            context.load_cert_chain(str(tls_cert), str(tls_key))
            # The handshake happens in the connection's own thread, at its first read: a slow client holds only that.
            self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True, do_handshake_on_connect=False)
        self.port = self.httpd.server_address[1]
        shown = f"[{host}]" if ":" in host else host
        self.url = f"{'https' if tls else 'http'}://{shown}:{self.port}/"
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="web-http", daemon=True)

    def start(self) -> WebServer:
        self.sessions.start()
        self._thread.start()
        return self

    def stop(self) -> None:
        self.sessions.stop()
        if self._thread.is_alive():  # shutdown() waits for serve_forever, which never ran on a server not started
            self.httpd.shutdown()
        self.httpd.server_close()


__all__ = ["WebServer", "Model", "Sessions", "InsecureBind", "JobState", "is_loopback"]
