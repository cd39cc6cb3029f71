"""The emulated network of ``benchmarks/netem.py`` with a delay: what its links carry arrives
intact, after the round trip asked for, at no more than the rate (root, namespaces and a TUN
device needed; skipped without them)."""

import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
try:
    import netem
finally:
    sys.path.remove(str(BENCHMARKS))

available, why = netem.namespaces_available()
pytestmark = pytest.mark.skipif(
    not available or not os.path.exists("/dev/net/tun"), reason=why or "no /dev/net/tun"
)

PAYLOAD = 4 << 20
SERVER = textwrap.dedent(f"""
    import hashlib, socket
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(({netem.Network.address(1)!r}, 5071))
    s.listen(1)
    print("listening", flush=True)
    c, _ = s.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(5):
        c.sendall(c.recv(1))
    digest, got = hashlib.sha256(), 0
    while got < {PAYLOAD}:
        data = c.recv(1 << 20)
        digest.update(data)
        got += len(data)
    c.sendall(digest.hexdigest().encode())
""")
CLIENT = textwrap.dedent(f"""
    import os, socket, sys, time
    c = socket.create_connection(({netem.Network.address(1)!r}, 5071))
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    trips = []
    for _ in range(5):
        start = time.perf_counter()
        c.sendall(b"p")
        c.recv(1)
        trips.append(time.perf_counter() - start)
    payload = sys.stdin.buffer.read()
    start = time.perf_counter()
    c.sendall(payload)
    digest = c.recv(64).decode()
    print(min(trips), time.perf_counter() - start, digest)
""")


@pytest.fixture
def network():
    net = netem.Network(2, delay=0.05, prefix="obtest")
    try:
        net.setup()
        yield net
    finally:
        net.close()


def test_a_delayed_link_carries_data_intact_after_its_round_trip_at_its_rate(network):
    network.set_rate(100e6)
    payload = os.urandom(PAYLOAD)
    server = subprocess.Popen(network.command(1, [sys.executable, "-c", SERVER]),
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert server.stdout.readline().strip() == "listening"
        done = subprocess.run(network.command(0, [sys.executable, "-c", CLIENT]),
                              input=payload, capture_output=True, timeout=60)  # fmt: skip
        assert done.returncode == 0, done.stderr.decode()
        trip, transfer, digest = done.stdout.decode().split()
    finally:
        server.kill()
        server.wait()
    assert digest == hashlib.sha256(payload).hexdigest()
    assert 0.1 <= float(trip) < 0.15
    # 4 MiB at 100 Mbit/s take 0.34 s, plus the round trip of the digest
    assert float(transfer) >= PAYLOAD * 8 / 100e6 + 0.1
    assert network.relay_cpu_s() > 0


def test_closing_the_network_stops_the_relay_and_removes_the_hosts(network):
    relay = network.relay
    network.close()
    assert relay.poll() is not None
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "obtest-" not in listing
