"""Test hosts as Linux network namespaces: each has a veth into a bridge (itself in a namespace of its own) and an
address from the benchmarking range 198.18.0.0/15, so that multi-host tests see real interface addresses and routes,
and a partition is a link taken down. The test process joins the same network through a veth of the root namespace.
Everything is removed at the end; `unavailable()` says why namespaces cannot be made here (the test then skips).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass, field

SUBNET = "198.18.{net}.{host}/24"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


def unavailable() -> str | None:
    """Why network namespaces cannot be used for test hosts here; None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    name = f"phx-probe-{uuid.uuid4().hex[:6]}"
    probe = _ip("netns", "add", name, check=False)
    if probe.returncode != 0:
        return f"cannot create a network namespace: {probe.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


@dataclass
class Network:
    """A bridge and the hosts plugged into it. `hosts[name]` is the host's address; `run(name, argv)` is argv as a
    command inside the host's namespace."""

    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:5])
    net: int = 0
    hosts: dict[str, str] = field(default_factory=dict)
    _links: dict[str, str] = field(default_factory=dict)  # host -> its veth inside its namespace
    _root_link: str = ""

    def __post_init__(self) -> None:
        self.net = int(self.tag, 16) % 250
        self.bridge_ns = f"phx-br-{self.tag}"
        _ip("netns", "add", self.bridge_ns)
        self._in(self.bridge_ns, "ip", "link", "add", "br0", "type", "bridge")
        self._in(self.bridge_ns, "ip", "link", "set", "br0", "up")

    def ns(self, host: str) -> str:
        return f"phx-{self.tag}-{host}"

    def _in(self, ns: str, *argv: str) -> None:
        subprocess.run(["ip", "netns", "exec", ns, *argv], check=True, capture_output=True, timeout=20)

    def _plug(self, ns: str | None, index: int) -> tuple[str, str]:
        """A veth pair: one end in `ns` (None: the root namespace) with address .index, the other on the bridge."""
        inner, outer = f"v{self.tag}{index}", f"b{self.tag}{index}"
        _ip("link", "add", inner, "type", "veth", "peer", "name", outer)
        _ip("link", "set", outer, "netns", self.bridge_ns)
        self._in(self.bridge_ns, "ip", "link", "set", outer, "master", "br0")
        self._in(self.bridge_ns, "ip", "link", "set", outer, "up")
        address = SUBNET.format(net=self.net, host=index)
        if ns is None:
            _ip("addr", "add", address, "dev", inner)
            _ip("link", "set", inner, "up")
        else:
            _ip("link", "set", inner, "netns", ns)
            self._in(ns, "ip", "addr", "add", address, "dev", inner)
            self._in(ns, "ip", "link", "set", inner, "up")
            self._in(ns, "ip", "link", "set", "lo", "up")
        return inner, address.split("/")[0]

    def add_host(self, name: str) -> str:
        ns = self.ns(name)
        _ip("netns", "add", ns)
        link, address = self._plug(ns, len(self.hosts) + 1)
        self.hosts[name], self._links[name] = address, link
        return address

    def join_from_root(self) -> str:
        """Plug the test process's own (root) namespace into the network; returns its address."""
        self._root_link, address = self._plug(None, 254)
        return address

    def command(self, host: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns(host), *argv]

    def set_link(self, host: str, up: bool) -> None:
        """Cut a host off the network (a partition) or plug it back."""
        self._in(self.ns(host), "ip", "link", "set", self._links[host], "up" if up else "down")

    def close(self) -> None:
        if self._root_link:
            _ip("link", "del", self._root_link, check=False)
        for host in self.hosts:
            _ip("netns", "del", self.ns(host), check=False)
        _ip("netns", "del", self.bridge_ns, check=False)
