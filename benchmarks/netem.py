"""An emulated, bandwidth-limited network of hosts on one Linux machine (root only).

Each host is a network namespace (``obnet-h0``, ``obnet-h1``...) with one veth link to a bridge
in its own namespace (``obnet-br``), address ``10.77.0.(k+1)/24``, interface ``eth0``; nothing is
routed anywhere else. :meth:`Network.set_rate` limits every link in both directions with
``tc tbf``: on the host side of the veth (what the host sends) and on the bridge side (what it
receives). :func:`tx_bytes` reads what an interface really sent, headers and retransmissions
included.
"""

from __future__ import annotations

import os
import shutil
import subprocess

PREFIX = "obnet"
SUBNET = "10.77.0"
BRIDGE_NS = f"{PREFIX}-br"
INTERFACE = "eth0"
"""Each host's link, inside its namespace."""


def parse_rate(text: str) -> float:
    """``"100mbit"``, ``"1gbit"``, ``"2.5gbit"`` or bits/s as a number, to bits per second."""
    text = text.strip().lower()
    for suffix, factor in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * factor
    return float(text)


def rate_name(bits: float | None) -> str:
    """A rate for people, ``"100 Mbit/s"``; ``None`` is plain loopback (no emulation)."""
    if bits is None:
        return "loopback"
    if bits >= 1e9:
        return f"{bits / 1e9:g} Gbit/s"
    return f"{bits / 1e6:g} Mbit/s"


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


class Network:
    """``hosts`` namespaces on one bridge, each link limited with tbf in both directions."""

    def __init__(self, hosts: int) -> None:
        self.hosts = hosts
        self.namespaces = [f"{PREFIX}-h{k}" for k in range(hosts)]

    @staticmethod
    def address(k: int) -> str:
        """Host ``k``'s IP address."""
        return f"{SUBNET}.{k + 1}"

    @staticmethod
    def cleanup() -> None:
        """Remove every namespace and stray veth of this benchmark (also an earlier run's)."""
        listing = _run("ip", "netns", "list", check=False).stdout.split("\n")
        for line in listing:
            name = line.split(" ")[0]
            if name.startswith(f"{PREFIX}-"):
                _run("ip", "netns", "pids", name, check=False)
                _run("ip", "netns", "del", name, check=False)
        links = _run("ip", "-o", "link", "show", check=False).stdout.split("\n")
        for line in links:
            parts = line.split(": ")
            if len(parts) > 1 and parts[1].split("@")[0].startswith(("obh", "obp")):
                _run("ip", "link", "del", parts[1].split("@")[0], check=False)

    def setup(self) -> None:
        """Build the bridge and the hosts, unlimited, after removing any leftovers."""
        self.cleanup()
        _run("ip", "netns", "add", BRIDGE_NS)
        _run("ip", "-n", BRIDGE_NS, "link", "set", "lo", "up")
        _run("ip", "-n", BRIDGE_NS, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", BRIDGE_NS, "link", "set", "br0", "up")
        for k, ns in enumerate(self.namespaces):
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", f"obh{k}", "type", "veth", "peer", "name", f"obp{k}")
            _run("ip", "link", "set", f"obh{k}", "netns", ns)
            _run("ip", "link", "set", f"obp{k}", "netns", BRIDGE_NS)
            _run("ip", "-n", ns, "link", "set", f"obh{k}", "name", INTERFACE)
            _run("ip", "-n", ns, "addr", "add", f"{self.address(k)}/24", "dev", INTERFACE)
            _run("ip", "-n", ns, "link", "set", INTERFACE, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", BRIDGE_NS, "link", "set", f"obp{k}", "master", "br0")
            _run("ip", "-n", BRIDGE_NS, "link", "set", f"obp{k}", "up")

    def set_rate(self, bits: float) -> None:
        """Limit every link to ``bits``/s each way: tbf on both ends of each veth."""
        rate_bytes = bits / 8
        # The bucket must hold a GSO super-packet (64 KiB) and a few ms at the rate.
        burst = max(128 * 1024, int(rate_bytes * 0.004))
        args = ["root", "tbf", "rate", f"{int(bits)}bit", "burst", str(burst), "latency", "100ms"]
        for k, ns in enumerate(self.namespaces):
            _run("tc", "-n", ns, "qdisc", "replace", "dev", INTERFACE, *args)
            _run("tc", "-n", BRIDGE_NS, "qdisc", "replace", "dev", f"obp{k}", *args)

    def command(self, k: int, argv: list[str]) -> list[str]:
        """``argv`` run inside host ``k``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[k], *argv]


def namespaces_available() -> tuple[bool, str]:
    """Whether this process can build the emulated network, and why not."""
    if os.geteuid() != 0:
        return False, "not root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"'{tool}' not found (apt-get install iproute2)"
    probe = f"{PREFIX}-probe"
    _run("ip", "netns", "del", probe, check=False)
    result = _run("ip", "netns", "add", probe, check=False)
    _run("ip", "netns", "del", probe, check=False)
    if result.returncode:
        return False, f"ip netns add failed: {result.stderr.strip()}"
    return True, ""


def tx_bytes(interface: str, dev: str | None = None) -> int:
    """Bytes ``interface`` has sent so far, from ``dev`` (the text of a ``/proc/net/dev``; by
    default this process's namespace's)."""
    if dev is None:
        with open("/proc/net/dev") as f:
            dev = f.read()
    for line in dev.splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == interface:
            return int(fields.split()[8])
    raise RuntimeError(f"interface {interface} not in /proc/net/dev")
