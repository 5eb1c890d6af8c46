"""Measures a lab link the way the swarm uses it: TCP round trips and TCP throughput between two hosts.

``python -m bench.wanlab.probe serve PORT`` listens (prints ``listening`` once it does); a connection's first
byte picks its mode: ``e`` echoes single bytes back (round trips), ``s`` reads until end of stream, then answers
the bytes it read and the seconds from the first to the last (throughput at the receiver, so the sender's
buffers do not count). ``python -m bench.wanlab.probe measure HOST PORT SECONDS`` prints one JSON object:
``rtt_ms`` (median of 20 one-byte echoes with Nagle off, after one warm-up) and ``mbit`` (megabits per second
received in a ``SECONDS``-long bulk send, slow start included: a long enough send amortizes it).
"""

from __future__ import annotations

import json
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

ECHOES = 20
CHUNK = 1 << 16
ROOT = Path(__file__).resolve().parents[2]


def _serve_one(conn: socket.socket) -> None:
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        mode = conn.recv(1)
        if mode == b"e":
            while byte := conn.recv(1):
                conn.sendall(byte)
        elif mode == b"s":
            total, first = 0, None
            while data := conn.recv(CHUNK):
                first = first or time.monotonic()
                total += len(data)
            conn.sendall(struct.pack("!Qd", total, time.monotonic() - (first or time.monotonic())))


def serve(port: int) -> None:
    with socket.create_server(("0.0.0.0", port), reuse_port=False) as srv:
        print("listening", flush=True)
        while True:
            conn, _ = srv.accept()
            threading.Thread(target=_serve_one, args=(conn,), daemon=True).start()


def measure(host: str, port: int, seconds: float) -> dict:
    with socket.create_connection((host, port), timeout=30) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(b"e")
        rtts = []
        for _ in range(ECHOES + 1):
            t0 = time.perf_counter()
            s.sendall(b"x")
            if s.recv(1) != b"x":
                raise RuntimeError("the echo server closed the connection")
            rtts.append((time.perf_counter() - t0) * 1000)
    with socket.create_connection((host, port), timeout=30 + seconds) as s:
        s.sendall(b"s")
        block = b"\0" * CHUNK
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            s.sendall(block)
        s.shutdown(socket.SHUT_WR)
        reply = b""
        while len(reply) < 16:
            data = s.recv(16 - len(reply))
            if not data:
                raise RuntimeError("the sink closed the connection before answering")
            reply += data
    total, elapsed = struct.unpack("!Qd", reply)
    return {"rtt_ms": round(statistics.median(rtts[1:]), 2), "mbit": round(total * 8 / max(elapsed, 1e-6) / 1e6, 2),
            "bytes": total, "seconds": round(elapsed, 3)}


def measure_between(server_prefix: list[str], client_prefix: list[str], host: str, port: int,
                    seconds: float) -> dict:
    """Start a probe server under ``server_prefix`` (e.g. ``ip netns exec NS``; [] on this host), run
    :func:`measure` against ``host:port`` under ``client_prefix`` and return its figures; the server is stopped.

    :raises RuntimeError: the server did not start, or the measurement failed (its output is in the message).
    """
    probe = [sys.executable, "-m", "bench.wanlab.probe"]
    server = subprocess.Popen([*server_prefix, *probe, "serve", str(port)], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        if server.stdout.readline().strip() != "listening":
            raise RuntimeError(f"the probe server did not start: {server.stderr.read()[-1000:]}")
        done = subprocess.run([*client_prefix, *probe, "measure", host, str(port), str(seconds)], cwd=ROOT,
                              capture_output=True, text=True, timeout=60 + seconds)
        if done.returncode != 0:
            raise RuntimeError(f"measuring {host}:{port} failed: {done.stderr.strip()[-1000:]}")
        return json.loads(done.stdout)
    finally:
        server.kill()
        server.wait()


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(int(sys.argv[2]))
    else:
        print(json.dumps(measure(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))), flush=True)
