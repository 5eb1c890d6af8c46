"""Build the peer image with podman and check that a peer container joins a local run and serves.

    python docker/check.py        # `make container-check`; needs root (apt-get, debootstrap) or podman + a base image
    python docker/check.py --ci   # CI: skip (exit 0, saying why) only if this machine cannot run containers

Steps: (1) a base image: ``localhost/swarm-base:bookworm`` from ``debootstrap`` + ``podman import`` unless it
exists (no registry is reachable here); (2) a wheelhouse in docker/wheels (``pip wheel .``: the project and
every dependency, so the build needs no network); (3) ``hadolint`` on the Dockerfile; (4) ``podman build
--runtime runc --network=none --format docker``; (5) a local run on the host (coordinator + a stage-1 server +
a trainer) and a peer *container* serving stage 0 through ``--network=host``: it must come online, training
must advance two epochs through it, its HEALTHCHECK command (``swarm-peer status --probe``) must pass, it must
serve Prometheus metrics on port 9100, ``podman exec ... swarm-peer pause`` and ``resume`` must take it out
of and back into the stage, and ``podman stop`` (SIGTERM: drain) must end it with exit code 0.
Prints one JSON line with the seconds each step took.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BASE = "localhost/swarm-base:bookworm"
IMAGE = "localhost/swarm-peer:check"
PODMAN = ["podman"]
RUN = ["--runtime", "runc", "--pull=never", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]


def sh(*cmd: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), check=True, **kw)


def base_image() -> None:
    if subprocess.run(PODMAN + ["image", "exists", BASE]).returncode == 0:
        return
    if shutil.which("debootstrap") is None:
        sh("apt-get", "update", "-q", stdout=subprocess.DEVNULL)
        sh("apt-get", "install", "-y", "-q", "debootstrap", stdout=subprocess.DEVNULL)
    with tempfile.TemporaryDirectory() as root:
        sh("debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates", "bookworm", root,
           "http://deb.debian.org/debian", stdout=subprocess.DEVNULL)
        tar = subprocess.Popen(["tar", "-C", root, "-c", "."], stdout=subprocess.PIPE)
        sh(*PODMAN, "import", "-", BASE, stdin=tar.stdout, stdout=subprocess.DEVNULL)
        tar.wait()


def prerequisites() -> None:
    """podman + runc (installed with apt-get if missing) that can run a container, and the base image.

    :raises OSError, subprocess.CalledProcessError: this machine cannot run containers.
    """
    if shutil.which("podman") is None or shutil.which("runc") is None:
        sh("apt-get", "update", "-q", stdout=subprocess.DEVNULL)
        sh("apt-get", "install", "-y", "-q", "podman", "runc", stdout=subprocess.DEVNULL)
    base_image()
    sh(*PODMAN, "run", *RUN, "--rm", "--network=none", BASE, "true")


def main() -> None:
    timings = {}
    t = time.monotonic()
    try:
        prerequisites()
    except (OSError, subprocess.CalledProcessError) as e:
        if "--ci" not in sys.argv:
            raise
        print(json.dumps({"skipped": f"this machine cannot run containers ({e}); the image was not checked"}))
        return
    timings["base_image_s"] = round(time.monotonic() - t, 1)
    t = time.monotonic()
    sh(sys.executable, "-m", "pip", "wheel", "-q", "--wheel-dir", str(ROOT / "docker" / "wheels"), str(ROOT))
    timings["wheels_s"] = round(time.monotonic() - t, 1)
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    sh(hadolint, str(ROOT / "docker" / "Dockerfile"))
    t = time.monotonic()
    sh(*PODMAN, "build", "--runtime", "runc", "--network=none", "--format", "docker", "-f", "docker/Dockerfile",
       "--build-arg", f"BASE_IMAGE={BASE}", "-t", IMAGE, ".", cwd=ROOT, stdout=subprocess.DEVNULL)
    timings["build_s"] = round(time.monotonic() - t, 1)
    t = time.monotonic()
    timings.update(run_check())
    timings["run_s"] = round(time.monotonic() - t, 1)
    print(json.dumps(timings))


def run_check() -> dict:
    from coordinator.launch import LocalSwarm
    from tests.scenario import Scenario

    work = Path(tempfile.mkdtemp(prefix="swarm-container-"))
    shutil.copy(ROOT / "runs" / "tiny.toml", work / "tiny.toml")
    cache = work / "cache"  # the container's /cache: a copy of the test data cache, owned by its user (uid 10001)
    shutil.copytree(ROOT / ".test-cache", cache, ignore=shutil.ignore_patterns("fragments", "identity.key"))
    sh("chown", "-R", "10001:10001", str(cache))
    name = "swarm-peer-check"
    with LocalSwarm(work / "tiny.toml", work / "swarm", ROOT / ".test-cache") as swarm, Scenario(swarm) as sc:
        swarm.start_peer("server", "--stage", "1")
        cmd = PODMAN + ["run", *RUN, "--rm", "--name", name, "--network=host", "-v", f"{cache}:/cache",
                        "-e", "SWARM_HOST=127.0.0.1", "-e", "SWARM_PORT=0", "-e", "SWARM_IDENTITY_FILE=/tmp/peer.key",
                        "-e", "SWARM_FRAGMENT_DIR=/tmp/fragments", IMAGE, "join", swarm.address, "--stage", "0"]
        log = open(work / "container.log", "w")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            sc.wait(lambda: any(s.state == "online" for s in sc.directory.servers(0)), 300, "the container online")
            served = [s.peer_id for s in sc.directory.servers(0)]
            sc.trainers(1).until_epoch(2, timeout=240)
            epochs = sc.epochs()
            health = subprocess.run(PODMAN + ["exec", name, "swarm-peer", "status", "--probe"], capture_output=True,
                                    text=True)
            if health.returncode != 0:
                raise SystemExit(f"the HEALTHCHECK command fails in the running container: {health.stdout}{health.stderr}")
            import urllib.request  # the image serves Prometheus metrics on SWARM_METRICS_PORT=9100 (host network)
            scraped = urllib.request.urlopen("http://127.0.0.1:9100/metrics", timeout=10).read().decode()
            if "swarm_epoch{" not in scraped:
                raise SystemExit("the container serves no swarm_epoch metric on :9100/metrics")
            for command, state in (("pause", "paused"), ("resume", "online")):  # what `docker exec` users run
                done = subprocess.run(PODMAN + ["exec", name, "swarm-peer", command, "--timeout", "60"],
                                      capture_output=True, text=True)
                if done.returncode != 0:
                    raise SystemExit(f"`swarm-peer {command}` failed in the container: {done.stdout}{done.stderr}")
                sc.wait(lambda st=state: any(s.peer_id == served[0] and s.state == st
                                             for s in sc.directory.servers(0)), 60, f"the container {state}")
        finally:
            subprocess.run(PODMAN + ["kill", "--signal", "TERM", name], capture_output=True)
            try:
                code = proc.wait(30)
            except subprocess.TimeoutExpired:  # it did not exit: have it print what it waits on, then stop it
                subprocess.run(PODMAN + ["kill", "--signal", "USR1", name], capture_output=True)
                time.sleep(3)
                subprocess.run(PODMAN + ["stop", "-t", "5", name], capture_output=True)
                code = proc.wait(60)
        if code != 0:
            raise SystemExit(f"the peer container exited with {code} after SIGTERM; see {work / 'container.log'}")
    # a peer forced out by its exit watchdog passes, but says so here, with the stacks it logged
    forced = [line for line in (work / "container.log").read_text(errors="replace").splitlines()
              if "did not exit within" in line]
    if forced:
        print((work / "container.log").read_text(errors="replace")[-20000:], file=sys.stderr)
    shutil.rmtree(work, ignore_errors=True)  # kept only after a failure, for its container.log
    return {"container_peer": served[0], "epochs": epochs, "exit_code": code, "exit_forced": bool(forced)}


if __name__ == "__main__":
    main()
