"""A real Ray cluster on this machine for tests: a head and more nodes, each a `ray start
--block` in a session of its own (its raylet and worker processes stay in that session even
when Ray gives workers process groups of their own), each with its own Ray temp dir and
orchestrator state directory, so that a test can kill exactly one node (SIGKILL to every
process of its session) and stop exactly its cluster."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

RAY = str(Path(sys.executable).with_name("ray"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def session_pids(sid: int) -> list[int]:
    """Every live process of the session `sid` (zombies, dead already, left out)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getsid(int(entry.name)) != sid:
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (ProcessLookupError, PermissionError, OSError, IndexError):
            continue
        if state != "Z":
            pids.append(int(entry.name))
    return pids


@dataclass
class RayNode:
    proc: subprocess.Popen[bytes]
    temp_dir: Path
    home: Path
    log: Path

    def node_id(self, timeout: float = 60) -> str:
        """This node's Ray node id, from its raylet's command line."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for pid in session_pids(self.proc.pid):
                try:
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                for arg in argv:
                    if arg.startswith(b"--node_id="):
                        return arg.split(b"=", 1)[1].decode()
            time.sleep(0.2)
        raise AssertionError(f"no raylet found for the node in {self.temp_dir}")

    def processes(self, title: str) -> list[int]:
        """The node's processes whose command line starts with `title` (Ray names an
        actor's worker process `ray::ClassName...`)."""
        found = []
        for pid in session_pids(self.proc.pid):
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(title.encode()):
                    found.append(pid)
            except OSError:
                continue
        return found

    def kill(self) -> None:
        """SIGKILL every process of the node (raylet, workers, the `ray start`), not politely;
        until none is left."""
        for _ in range(50):
            pids = session_pids(self.proc.pid)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


# What `ray start` prints when its own fixed wait for the raylet to register with the GCS
# (30 s, not configurable in Ray 2.x) ran out: on a machine busy with a whole test tier that
# can happen to a healthy node, so the node is started again from scratch.
RAY_STARTUP_TIMEOUT = b"timed out during startup"
START_ATTEMPTS = 3


def start_node(
    tmp: Path,
    name: str,
    *,
    sandboxes: int,
    head_address: str | None = None,
    env: dict[str, str] | None = None,
) -> tuple[RayNode, str]:
    """Start a node (the head when `head_address` is None) with `sandboxes` units of
    `orchestrator_sandboxes`; waits until Ray says it started, starting it again (up to
    START_ATTEMPTS times, each in fresh directories) when Ray gave up on its own fixed startup
    wait. Returns the node and the cluster's address; raises AssertionError with Ray's log
    otherwise."""
    for attempt in range(1, START_ATTEMPTS + 1):
        node, address = _start_node_once(
            tmp, name, attempt, sandboxes=sandboxes, head_address=head_address, env=env
        )
        log = node.log.read_bytes()
        if b"Ray runtime started" in log:
            return node, address
        if RAY_STARTUP_TIMEOUT not in log:
            break
    raise AssertionError(
        f"ray start failed (attempt {attempt}):\n{log.decode(errors='replace')[-3000:]}"
    )


def _start_node_once(
    tmp: Path,
    name: str,
    attempt: int,
    *,
    sandboxes: int,
    head_address: str | None,
    env: dict[str, str] | None,
) -> tuple[RayNode, str]:
    """One `ray start`: the node once Ray says it started, or killed (every process of its
    session) once `ray start` exited or 120 s passed; the caller reads its log."""
    temp_dir = tmp / f"r{attempt}-{name}"  # short: Ray's socket paths under it must fit 107 bytes
    home = tmp / f"home-{name}-{attempt}"
    home.mkdir(parents=True, exist_ok=True)
    log = tmp / f"ray-{name}-{attempt}.log"
    resources = json.dumps({"orchestrator_sandboxes": sandboxes}) if sandboxes else "{}"
    command = [
        RAY,
        "start",
        "--block",
        "--num-cpus",
        "1",
        "--temp-dir",
        str(temp_dir),
        "--resources",
        resources,
        "--object-store-memory",
        str(100 * 1024 * 1024),
        "--dashboard-agent-listen-port",
        str(free_port()),
        "--disable-usage-stats",
    ]
    if head_address is None:
        port = free_port()
        address = f"127.0.0.1:{port}"
        command += ["--head", "--port", str(port), "--include-dashboard=false"]
    else:
        address = head_address
        command += ["--address", address]
    environment = {**os.environ, "ORCHESTRATOR_HOME": str(home), **(env or {})}
    environment.pop("RAY_ADDRESS", None)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=environment, start_new_session=True
        )
    node = RayNode(proc, temp_dir, home, log)
    deadline = time.monotonic() + 120
    while b"Ray runtime started" not in log.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            node.kill()
            break
        time.sleep(0.2)
    return node, address
