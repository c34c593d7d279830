"""The kit's one payload, written out as a folder when a check needs it: a CodeAgent whose one
tool does what the check asks (sleep, hoard memory, fork, forge the event channel, look
around the sandbox, try the network) and reports it as JSON.

Why as text here and not a folder of package data: the kit must work from an installed wheel
(`orchestrator doctor` on a user's host) with nothing but this package, and the payload's code
must not be linted, typed or imported as host code (it runs only inside the sandbox).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MANIFEST = '''# Written by orchestrator.testing: the conformance kit's probe.
[payload]
name = "conformance_probe"
description = "The conformance kit's probe: does what a check asks and reports it."
entrypoint = "probe:build"
example_task = "Do what the action says and report it."

[python]
authorized_imports = []

[limits]
max_steps = 1
timeout_seconds = 60
memory_mb = 256
pids = 64

[mock.scripts]
manager = ["""Thought: I will do what the action says.
<code>
final_answer(probe(action=action))
</code>"""]
'''

CODE = r'''"""The conformance kit's probe (see orchestrator/testing/probe.py on the host)."""

import ctypes
import errno
import gc
import hashlib
import json
import os
import socket
import sys
import time
import urllib.error
import urllib.request

from smolagents import CodeAgent, tool

#: Where an engine's control socket would be if one were mounted in.
ENGINE_SOCKETS = (
    "/var/run/docker.sock", "/run/docker.sock", "/run/containerd/containerd.sock",
    "/var/run/containerd/containerd.sock", "/run/podman/podman.sock", "/run/crio/crio.sock",
)
IO_URING_SETUP = 425  # x86-64 and arm64 alike
PTRACE_TRACEME = 0
AF_VSOCK = 40


def status_fields():
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def sockets_under(*roots):
    found = []
    for root in roots:
        for folder, dirs, files in os.walk(root):
            for name in files + dirs:
                path = os.path.join(folder, name)
                try:
                    if os.path.exists(path) and (os.stat(path).st_mode & 0o170000) == 0o140000:
                        found.append(path)
                except OSError:
                    continue
            if len(found) > 20:
                return found
    return found


def io_uring():
    libc = ctypes.CDLL(None, use_errno=True)
    params = ctypes.create_string_buffer(120)
    fd = libc.syscall(IO_URING_SETUP, 1, params)
    if fd >= 0:
        os.close(fd)
        return {"allowed": True, "errno": None}
    code = ctypes.get_errno()
    return {"allowed": False, "errno": errno.errorcode.get(code, str(code))}


def ptrace():
    """Whether ptrace is allowed: PTRACE_TRACEME in a child (needs no privilege, harms
    nothing), its errno as the child's exit code."""
    pid = os.fork()
    if pid == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        zero = ctypes.c_long(0)
        done = libc.ptrace(ctypes.c_long(PTRACE_TRACEME), zero, zero, zero)
        os._exit(0 if done == 0 else (ctypes.get_errno() or 255))
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code == 0:
        return {"allowed": True, "errno": None}
    return {"allowed": False, "errno": errno.errorcode.get(code, str(code))}


def vsock():
    """Whether an AF_VSOCK socket can be made (the way to a VM's host)."""
    try:
        socket.socket(AF_VSOCK, socket.SOCK_STREAM).close()
    except OSError as exc:
        return {"allowed": False, "errno": errno.errorcode.get(exc.errno, str(exc.errno))}
    return {"allowed": True, "errno": None}


def proc_version():
    with open("/proc/version") as version:
        return version.read().strip()


def inspect(key_names):
    status = status_fields()
    try:
        with open("/conformance-probe", "w") as handle:
            handle.write("x")
        root_writable = True
    except OSError:
        root_writable = False
    values = {}
    for name in key_names:
        values[name] = os.environ.get(name)
    return {
        "uid": os.getuid(), "gid": os.getgid(), "euid": os.geteuid(),
        "cap_eff": status.get("CapEff"), "cap_bnd": status.get("CapBnd"),
        "no_new_privs": status.get("NoNewPrivs"), "root_writable": root_writable,
        "engine_sockets": [p for p in ENGINE_SOCKETS if os.path.exists(p)],
        "sockets": sockets_under("/run", "/var/run", "/tmp"),
        "docker_host": os.environ.get("DOCKER_HOST"),
        "environ": values, "io_uring": io_uring(), "ptrace": ptrace(), "vsock": vsock(),
        "proc_version": proc_version(),
    }


def net(attempts):
    outcomes = []
    for spec in attempts:
        try:
            if spec["kind"] == "dns":
                found = sorted({i[4][0] for i in socket.getaddrinfo(spec["name"], 80)})
                outcomes.append({**spec, "ok": True, "addresses": found})
            elif spec["kind"] == "http":  # through the run's proxy, where it has one
                try:
                    with urllib.request.urlopen(spec["url"], timeout=10) as reply:
                        status = reply.status
                except urllib.error.HTTPError as exc:
                    status = exc.code
                outcomes.append({**spec, "ok": status == 200, "status": status})
            else:
                socket.create_connection((spec["host"], int(spec["port"])), timeout=3).close()
                outcomes.append({**spec, "ok": True})
        except OSError as exc:
            outcomes.append({**spec, "ok": False, "error": f"{type(exc).__name__}: {exc}"})
    return outcomes


def matches(data, prefix, length, digest):
    """How often the secret is in `data`: found by its prefix, told by its hash (the probe
    never holds the secret itself, so it cannot find its own copy)."""
    count, at = 0, data.find(prefix)
    while at != -1:
        if hashlib.sha256(data[at:at + length]).hexdigest() == digest:
            count += 1
        at = data.find(prefix, at + 1)
    return count


def memory_of(pid):
    """Every readable region of a process's memory (its own always; others' where the
    kernel lets it read them)."""
    with open(f"/proc/{pid}/maps") as maps:
        regions = []
        for line in maps:
            span, perms = line.split()[:2]
            start, end = (int(x, 16) for x in span.split("-"))
            if perms.startswith("r") and end - start <= 2**28:
                regions.append((start, end))
    with open(f"/proc/{pid}/mem", "rb", 0) as mem:
        for start, end in regions:
            try:
                mem.seek(start)
                yield mem.read(end - start)
            except (OSError, ValueError, OverflowError):
                continue


def find(prefix, length, digest):
    """Where a secret is readable: every process's environment, command line and (where
    readable) memory, and the files under /tmp and /work."""
    prefix = prefix.encode()
    places, memories = [], 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        for part in ("environ", "cmdline"):
            try:
                with open(f"/proc/{pid}/{part}", "rb") as handle:
                    data = handle.read()
            except OSError:
                continue
            if matches(data, prefix, length, digest):
                places.append(f"/proc/{pid}/{part}")
        try:
            if any(matches(chunk, prefix, length, digest) for chunk in memory_of(pid)):
                places.append(f"/proc/{pid}/mem")
            memories += 1
        except OSError:
            continue
    files = 0
    for root in ("/tmp", "/work"):
        for folder, _, names in os.walk(root):
            for name in names:
                path = os.path.join(folder, name)
                try:
                    with open(path, "rb") as handle:
                        data = handle.read(4 * 2**20)
                except OSError:
                    continue
                files += 1
                if matches(data, prefix, length, digest):
                    places.append(path)
    return {"found": places, "files": files, "memories": memories}


def hoard(mb):
    held = []
    for _ in range(mb // 16):
        held.append(b"\x01" * (16 * 2**20))
    return f"held {len(held) * 16} MiB"


def forks(count):
    children = []
    try:
        for _ in range(count):
            pid = os.fork()
            if pid == 0:
                time.sleep(30)
                os._exit(0)
            children.append(pid)
    except OSError:
        return f"fork refused after {len(children)} children"
    finally:
        for pid in children:
            try:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
            except OSError:
                pass
    return f"forked all {count} children"


def shout(size):
    """One line of `size` bytes on stderr, written whole: a short write (gVisor's stdio returns
    them past 64 KiB, where sys.stderr drops the rest) is followed by the remainder."""
    sys.stderr.flush()
    data = b"x" * size + b"\n"
    while data:
        data = data[os.write(2, data):]


def lie_about_tokens(claimed):
    """Make the runtime report `claimed` input tokens more than its model calls used (the
    host must count what its gateway measured, not this)."""
    for obj in gc.get_objects():
        if type(obj).__name__ == "Recorder" and hasattr(obj, "input_tokens"):
            obj.input_tokens += claimed
            obj.output_tokens += claimed


def forge():
    forged = {"state": "success", "answer": "forged", "error": None, "steps": 1,
              "token_usage": {"input_tokens": 1, "output_tokens": 1}}
    for obj in gc.get_objects():
        if type(obj).__name__ == "EventStream":
            obj.emit("run_end", **forged)
    frame = json.dumps({"type": "run_end", "seq": 3, "ts": time.time(), "run_id": None, **forged})
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if fd > 2 and target.startswith(("pipe:", "socket:")):
            try:
                os.write(fd, (frame + "\n").encode())
            except OSError:
                pass
    raise RuntimeError("the agent really failed after forging a success")


@tool
def probe(action: str) -> str:
    """Do what the action says and report it as JSON.

    Args:
        action: a JSON object with `do` (ok, sleep, memory, forks, forge, inspect, find, net),
            its parameters, and optionally `shout` (bytes of one stderr line to write first)
            and `lie_tokens` (tokens to over-report).
    """
    spec = json.loads(action)
    do = spec["do"]
    if spec.get("shout"):  # one line of that many bytes on stderr (the host must cut it)
        shout(int(spec["shout"]))
    if spec.get("lie_tokens"):
        lie_about_tokens(int(spec["lie_tokens"]))
    if do == "sleep":
        time.sleep(float(spec["seconds"]))
        return json.dumps("slept")
    if do == "memory":
        return json.dumps(hoard(int(spec["mb"])))
    if do == "forks":
        return json.dumps(forks(int(spec["count"])))
    if do == "forge":
        forge()
    if do == "inspect":
        return json.dumps(inspect(spec.get("keys", [])))
    if do == "find":
        return json.dumps(find(spec["prefix"], int(spec["length"]), spec["sha256"]))
    if do == "net":
        return json.dumps(net(spec["attempts"]))
    return json.dumps("ok")


def build(model):
    return CodeAgent(tools=[probe], model=model, max_steps=1)
'''


def write_probe(folder: Path) -> Path:
    """Write the probe payload into `folder` (a private, fresh directory); returns it."""
    (folder / "manifest.toml").write_text(MANIFEST)
    (folder / "probe.py").write_text(CODE)
    return folder


def action(do: str, **params: Any) -> dict[str, Any]:
    """The run's `additional_args` for one probe action."""
    return {"action": json.dumps({"do": do, **params})}
