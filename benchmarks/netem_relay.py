"""A link with a round trip, where the kernel has no ``netem``: a relay between hosts in user space.

    python benchmarks/netem_relay.py --hosts 4 --delay 0.05     # run by netem.Network(delay=...)

It creates one TUN device per host (``obt0``, ``obt1``...), which :class:`netem.Network` moves into
the hosts' namespaces as their ``eth0``. Every IP packet a host sends reaches this process, waits
the one-way ``delay``, then waits its turn on the receiving host's link (serialised at the rate,
first come first served, as a switch port would), and is written to that host's device. What a
host sends is limited in the kernel, by ``tc tbf`` on its ``eth0``, which drops what overflows, so
that TCP's congestion control sees a real bottleneck.

The devices carry TCP's 64 KiB segmentation-offload packets (``IFF_VNET_HDR``, ``TUN_F_TSO*``):
TCP counts its window in 1,448-byte segments, as on an Ethernet link, while the relay moves a few
thousand packets a second at 1 Gbit/s. Lines on standard input set the receiving rate
(``rate BITS``; 0: unlimited); ``ready`` is printed once the devices exist.
"""

from __future__ import annotations

import argparse
import fcntl
import heapq
import os
import select
import struct
import sys
import time

TUNSETIFF = 0x400454CA
TUNSETOFFLOAD = 0x400454D0
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
IFF_VNET_HDR = 0x4000
TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6 = 0x01, 0x02, 0x04
VNET_HDR = 10
"""``struct virtio_net_hdr``: what precedes each packet, passed on unchanged."""
MAX_PACKET = VNET_HDR + 65535


def open_tun(name: str) -> int:
    """A TUN device ``name`` with segmentation offload; its file descriptor."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(
        fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI | IFF_VNET_HDR)
    )
    fcntl.ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6)
    return fd


def destination(packet: bytes, subnet: bytes) -> int | None:
    """The host index an IPv4 packet is addressed to (``subnet.(k+1)``), else ``None``."""
    ip = packet[VNET_HDR:]
    if len(ip) < 20 or ip[0] >> 4 != 4 or ip[16:19] != subnet:
        return None
    return ip[19] - 1


def relay(fds: list[int], delay: float, subnet: bytes, control: int) -> None:
    """Move packets between ``fds`` until ``control`` closes."""
    hosts = len(fds)
    rate = 0.0
    link_free = [0.0] * hosts
    queue: list[tuple[float, int, int, bytes]] = []
    sequence = 0
    readers = [*fds, control]
    while True:
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            _, _, k, packet = heapq.heappop(queue)
            try:
                os.write(fds[k], packet)
            except OSError:
                pass  # the host's backlog is full: dropped, as a switch would drop it
        timeout = max(0.0, queue[0][0] - now) if queue else None
        ready, _, _ = select.select(readers, [], [], timeout)
        now = time.monotonic()
        for fd in ready:
            if fd == control:
                line = os.read(control, 4096).decode()
                if not line:
                    return
                for word in line.split("\n"):
                    if word.startswith("rate "):
                        rate = float(word.split()[1])
                continue
            while True:
                try:
                    packet = os.read(fd, MAX_PACKET)
                except BlockingIOError:
                    break
                except OSError as error:
                    sys.exit(f"netem_relay.py: a host's device is gone ({error})")
                k = destination(packet, subnet)
                if k is None or not 0 <= k < hosts:
                    continue
                arrival = now + delay
                if rate:
                    start = max(arrival, link_free[k])
                    link_free[k] = start + (len(packet) - VNET_HDR) * 8 / rate
                    arrival = link_free[k]
                sequence += 1
                heapq.heappush(queue, (arrival, sequence, k, packet))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", type=int, required=True)
    parser.add_argument("--delay", type=float, required=True, help="one way, in seconds")
    parser.add_argument("--subnet", default="10.77.0")
    parser.add_argument("--prefix", default="obt", help="the devices' names, before the index")
    args = parser.parse_args()
    fds = [open_tun(f"{args.prefix}{k}") for k in range(args.hosts)]
    print("ready", flush=True)
    subnet = bytes(int(x) for x in args.subnet.split("."))
    relay(fds, args.delay, subnet, sys.stdin.fileno())


if __name__ == "__main__":
    main()
