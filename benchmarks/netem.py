"""An emulated, bandwidth-limited network of hosts on one Linux machine (root only).

Each host is a network namespace (``obnet-h0``, ``obnet-h1``...) with one link, address
``10.77.0.(k+1)/24``, interface ``eth0``; nothing is routed anywhere else. Without a delay, each
link is a veth to a bridge in its own namespace (``obnet-br``). With one (``Network(hosts,
delay=0.05)``: 50 ms each way, a 100 ms round trip), each link is a TUN device of
``netem_relay.py``, a process that holds every packet for the delay before it delivers it: the
kernels this was written on have no ``netem`` queueing discipline. :meth:`Network.set_rate` limits
every link in both directions: ``tc tbf`` on the host's side (what the host sends), and ``tbf`` on
the bridge's side or the relay's own pacing (what it receives). :func:`tx_bytes` reads what an
interface really sent, headers and retransmissions included.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

PREFIX = "obnet"
SUBNET = "10.77.0"
INTERFACE = "eth0"
"""Each host's link, inside its namespace."""


def parse_rate(text: str) -> float:
    """``"100mbit"``, ``"1gbit"``, ``"2.5gbit"`` or bits/s as a number, to bits per second."""
    text = text.strip().lower()
    for suffix, factor in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * factor
    return float(text)


def parse_delay(text: str) -> float:
    """``"50ms"``, ``"0.05s"`` or seconds as a number, to seconds."""
    text = text.strip().lower()
    if text.endswith("ms"):
        return float(text[:-2]) / 1e3
    return float(text.removesuffix("s"))


def link_name(bits: float | None, delay: float = 0.0) -> str:
    """A link for people: ``"1 Gbit/s, 100 ms round trip"``."""
    name = rate_name(bits)
    return f"{name}, {2e3 * delay:g} ms round trip" if delay else name


def rate_name(bits: float | None) -> str:
    """A rate for people, ``"100 Mbit/s"``; ``None`` is plain loopback (no emulation)."""
    if bits is None:
        return "loopback"
    if bits >= 1e9:
        return f"{bits / 1e9:g} Gbit/s"
    return f"{bits / 1e6:g} Mbit/s"


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


RELAY = Path(__file__).with_name("netem_relay.py")
LONG_LINK_BUFFERS = "4096 131072 33554432"
"""TCP's buffer sizes (min, default, max) on hosts of a link with a delay: up to 32 MiB, a round
trip of 100 ms at 2.5 Gbit/s, as hosts on long fast links are tuned (Linux sends from 4 MiB)."""


class Network:
    """``hosts`` namespaces, each link limited in both directions; ``delay`` seconds each way."""

    def __init__(self, hosts: int, delay: float = 0.0, prefix: str = PREFIX) -> None:
        self.hosts = hosts
        self.delay = delay
        self.prefix = prefix
        self.namespaces = [f"{prefix}-h{k}" for k in range(hosts)]
        self.bridge = f"{prefix}-br"
        self.device = prefix[:2]
        """Host ``k``'s devices: ``<device>h<k>`` and ``<device>p<k>`` (veth), ``<device>t<k>``."""
        self.relay: subprocess.Popen | None = None

    @staticmethod
    def address(k: int) -> str:
        """Host ``k``'s IP address."""
        return f"{SUBNET}.{k + 1}"

    @staticmethod
    def cleanup(prefix: str = PREFIX) -> None:
        """Remove every namespace and stray link of the networks of ``prefix`` (also an earlier
        run's)."""
        listing = _run("ip", "netns", "list", check=False).stdout.split("\n")
        for line in listing:
            name = line.split(" ")[0]
            if name.startswith(f"{prefix}-"):
                _run("ip", "netns", "pids", name, check=False)
                _run("ip", "netns", "del", name, check=False)
        links = _run("ip", "-o", "link", "show", check=False).stdout.split("\n")
        for line in links:
            parts = line.split(": ")
            if len(parts) > 1 and parts[1].split("@")[0].startswith(
                tuple(prefix[:2] + c for c in "hpt")
            ):
                _run("ip", "link", "del", parts[1].split("@")[0], check=False)

    def close(self) -> None:
        """Stop the relay, if any, and remove the network."""
        if self.relay is not None:
            self.relay.stdin.close()  # the relay exits at the end of its input
            try:
                self.relay.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.relay.kill()
                self.relay.wait()
            self.relay = None
        self.cleanup(self.prefix)

    def setup(self) -> None:
        """Build the links and the hosts, unlimited, after removing any leftovers."""
        self.cleanup(self.prefix)
        if self.delay:
            self._setup_relay()
            return
        _run("ip", "netns", "add", self.bridge)
        _run("ip", "-n", self.bridge, "link", "set", "lo", "up")
        _run("ip", "-n", self.bridge, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.bridge, "link", "set", "br0", "up")
        for k in range(self.hosts):
            host, port = f"{self.device}h{k}", f"{self.device}p{k}"
            _run("ip", "link", "add", host, "type", "veth", "peer", "name", port)
            self._add_host(k, host)
            _run("ip", "link", "set", port, "netns", self.bridge)
            _run("ip", "-n", self.bridge, "link", "set", port, "master", "br0")
            _run("ip", "-n", self.bridge, "link", "set", port, "up")

    def _add_host(self, k: int, device: str) -> None:
        """Host ``k``'s namespace, with ``device`` (now in this one) as its ``eth0``, up."""
        ns = self.namespaces[k]
        _run("ip", "netns", "add", ns)
        _run("ip", "link", "set", device, "netns", ns)
        _run("ip", "-n", ns, "link", "set", device, "name", INTERFACE)
        _run("ip", "-n", ns, "addr", "add", f"{self.address(k)}/24", "dev", INTERFACE)
        _run("ip", "-n", ns, "link", "set", INTERFACE, "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")

    def relay_cpu_s(self) -> float:
        """CPU seconds the relay has used so far (0 without one): what the emulation took from
        the workers' cores."""
        if self.relay is None:
            return 0.0
        with open(f"/proc/{self.relay.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def _setup_relay(self) -> None:
        """Each host's ``eth0`` is one of the relay's TUN devices."""
        argv = [sys.executable, str(RELAY), "--hosts", str(self.hosts), "--delay", str(self.delay)]
        argv += ["--subnet", SUBNET, "--prefix", f"{self.device}t"]
        self.relay = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        line = self.relay.stdout.readline().strip()
        if line != "ready":
            self.close()
            raise RuntimeError(f"netem_relay.py did not start: {line!r}")
        for k, ns in enumerate(self.namespaces):
            self._add_host(k, f"{self.device}t{k}")
            for name in ("tcp_rmem", "tcp_wmem"):
                sysctl = ["sysctl", "-q", "-w", f"net.ipv4.{name}={LONG_LINK_BUFFERS}"]
                _run("ip", "netns", "exec", ns, *sysctl)

    def set_rate(self, bits: float) -> None:
        """Limit every link to ``bits``/s each way: tbf on both ends of each veth, or on the
        host's end of each TUN device and the relay's pacing of what it delivers."""
        rate_bytes = bits / 8
        # The bucket must hold a GSO super-packet (64 KiB) and a few ms at the rate.
        burst = max(128 * 1024, int(rate_bytes * 0.004))
        args = ["root", "tbf", "rate", f"{int(bits)}bit", "burst", str(burst), "latency", "100ms"]
        for k, ns in enumerate(self.namespaces):
            _run("tc", "-n", ns, "qdisc", "replace", "dev", INTERFACE, *args)
            if self.relay is None:
                port = f"{self.device}p{k}"
                _run("tc", "-n", self.bridge, "qdisc", "replace", "dev", port, *args)
        if self.relay is not None:
            self.relay.stdin.write(f"rate {bits}\n")
            self.relay.stdin.flush()

    def worker_env(self, rank: int, port: int) -> dict[str, str]:
        """This environment, plus what ``torchrun`` would give the one worker on host ``rank``,
        its gloo bound to the host's link and one torch thread."""
        return dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK="0",
            WORLD_SIZE=str(self.hosts),
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR=self.address(0),
            MASTER_PORT=str(port),
            GLOO_SOCKET_IFNAME=INTERFACE,
            OMP_NUM_THREADS="1",
        )

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
