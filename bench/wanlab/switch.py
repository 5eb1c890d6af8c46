"""The WAN lab's link emulator: one process that owns a TUN device in every host's network namespace and
carries IPv4 packets between them with each host's delay, loss and download rate.

The kernels of these machines have no ``netem``, so latency lives here, in user space. Every host's TUN device
(``wan0`` in its namespace, ``swl<pid>`` in the initial namespace for the observer) is opened by this process
after it enters that namespace (``setns(2)``), so one selector loop reads every packet any host sends to the
lab's subnet. A packet from host ``a`` to host ``b`` is written to ``b``'s device after

    one-way delay = (rtt_a + rtt_b) / 4      (so two hosts of one profile see rtt_ms of round trip)

plus the time it waits behind earlier packets on ``b``'s download link (``mbit_b``, serialized in order; a
packet that would wait more than ``queue_ms`` is dropped, as a router's tail drop does, so TCP sees loss
instead of an endless queue). Upload rates are the kernel's: the lab puts a ``tbf`` qdisc on each ``wan0``
(see :mod:`bench.wanlab.lab`). A packet is lost with probability ``loss_a + loss_b``.

It counts the IP bytes carried per (source, destination) pair and per protocol (tcp, udp) and writes them, with
packets carried and dropped,
as JSON to ``stats_path`` every half second. The devices are not persistent: they vanish with this process.

Run as ``python -m bench.wanlab.switch CONFIG.json`` (root); it prints ``ready`` on stdout once every device is
open and exits on SIGTERM or SIGINT.
"""

from __future__ import annotations

import ctypes
import fcntl
import heapq
import json
import os
import random
import selectors
import signal
import struct
import sys
import time
from dataclasses import dataclass

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
CLONE_NEWNET = 0x40000000
STATS_EVERY_S = 0.5


@dataclass
class Port:
    """One host's attachment: its TUN fd and link figures."""

    name: str
    fd: int
    rtt_ms: float
    mbit: float  # download rate; 0: not capped
    loss: float
    free_at: float = 0.0  # when its download link has sent everything queued so far (monotonic seconds)


def _setns(path: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def open_tun(name: str, netns: str | None) -> int:
    """Create TUN device ``name`` (no packet-info header) in network namespace ``netns`` (a path under
    /var/run/netns; None: this process's own) and return its non-blocking fd."""
    home = "/proc/self/ns/net"
    home_fd = os.open(home, os.O_RDONLY)
    try:
        if netns is not None:
            _setns(netns)
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
        return fd
    finally:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.setns(home_fd, CLONE_NEWNET)
        os.close(home_fd)


class Switch:
    """Carries packets between ports (see the module docstring)."""

    def __init__(self, ports: dict[str, Port], addresses: dict[bytes, str], queue_ms: float, stats_path: str,
                 seed: int = 0):
        self.ports, self.addresses, self.queue_s, self.stats_path = ports, addresses, queue_ms / 1000, stats_path
        self.rng = random.Random(seed)
        self.queue: list[tuple[float, int, str, bytes]] = []  # (due, seq, destination, packet)
        self.seq = 0
        self.bytes: dict[str, int] = {}  # "src>dst" -> IP bytes carried
        self.protocols: dict[int, int] = {}  # IP protocol number (6 TCP, 17 UDP) -> bytes carried
        self.carried = self.dropped = 0
        self.running = True

    def receive(self, src: Port, now: float) -> None:
        while True:
            try:
                packet = os.read(src.fd, 65536)
            except BlockingIOError:
                return
            if len(packet) < 20 or packet[0] >> 4 != 4:
                continue  # not IPv4 (the lab's hosts have IPv6 off)
            dst_name = self.addresses.get(packet[16:20])
            if dst_name is None or dst_name == src.name:
                self.dropped += 1
                continue
            dst = self.ports[dst_name]
            if self.rng.random() < src.loss + dst.loss:
                self.dropped += 1
                continue
            arrive = now + (src.rtt_ms + dst.rtt_ms) / 4000
            if dst.mbit > 0:
                start = max(arrive, dst.free_at)
                if start - arrive > self.queue_s:
                    self.dropped += 1
                    continue
                dst.free_at = start + len(packet) * 8 / (dst.mbit * 1e6)
                arrive = dst.free_at
            key = f"{src.name}>{dst_name}"
            self.bytes[key] = self.bytes.get(key, 0) + len(packet)
            self.protocols[packet[9]] = self.protocols.get(packet[9], 0) + len(packet)
            self.seq += 1
            heapq.heappush(self.queue, (arrive, self.seq, dst_name, packet))

    def deliver(self, now: float) -> None:
        while self.queue and self.queue[0][0] <= now:
            _, _, dst_name, packet = heapq.heappop(self.queue)
            try:
                os.write(self.ports[dst_name].fd, packet)
                self.carried += 1
            except OSError:  # the device is going away, or its queue is full
                self.dropped += 1

    def write_stats(self) -> None:
        tmp = self.stats_path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"bytes": self.bytes, "protocols": {{6: "tcp", 17: "udp"}.get(k, str(k)): v
                                                           for k, v in self.protocols.items()},
                       "packets": self.carried, "dropped": self.dropped}, fh)
        os.replace(tmp, self.stats_path)

    def run(self) -> None:
        parent = os.getppid()
        sel = selectors.DefaultSelector()
        for port in self.ports.values():
            sel.register(port.fd, selectors.EVENT_READ, port)
        next_stats = time.monotonic()
        while self.running:
            now = time.monotonic()
            timeout = min(STATS_EVERY_S, max(0.0, self.queue[0][0] - now)) if self.queue else STATS_EVERY_S
            for key, _ in sel.select(timeout):
                self.receive(key.data, time.monotonic())
            now = time.monotonic()
            self.deliver(now)
            if now >= next_stats:
                self.write_stats()
                next_stats = now + STATS_EVERY_S
                if os.getppid() != parent:  # the lab's process died without stopping us (SIGKILL)
                    self.running = False
        self.write_stats()


def main(config_path: str) -> None:
    config = json.loads(open(config_path).read())
    ports, addresses = {}, {}
    for host in config["hosts"]:
        fd = open_tun(host["device"], host["netns"])
        ports[host["name"]] = Port(host["name"], fd, host["rtt_ms"], host["mbit"], host["loss"])
        addresses[bytes(int(x) for x in host["ip"].split("."))] = host["name"]
    switch = Switch(ports, addresses, config["queue_ms"], config["stats_path"], config.get("seed", 0))

    def stop(*_):
        switch.running = False

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print("ready", flush=True)
    switch.run()


if __name__ == "__main__":
    main(sys.argv[1])
