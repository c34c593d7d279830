"""The sandbox-kernel tests' probe: what the kernel answers to the calls our seccomp profile
refuses (`io_uring_setup`, `unshare` of a user namespace, `ptrace`, an AF_VSOCK socket) and to
`clone3` (ENOSYS, so that the C library falls back to `clone`, whose flags are checked), from
a tool (plain Python, outside the agent's interpreter), which kernel it is, and whether a
seccomp filter is in force on the tool's process."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import platform
import socket
from collections.abc import Callable

from smolagents import CodeAgent, tool

#: io_uring_setup's number on x86-64 and arm64 (the generic table) alike.
IO_URING_SETUP = 425
CLONE3 = 435
CLONE_NEWUSER = 0x10000000
PTRACE_TRACEME = 0
AF_VSOCK = 40

_libc = ctypes.CDLL(None, use_errno=True)


def _answer(call: Callable[[], int]) -> dict[str, object]:
    """{"allowed": True} when the call succeeded, else the errno's name."""
    try:
        result = call()
    except OSError as exc:
        code = exc.errno or 0
        return {"allowed": False, "errno": errno.errorcode.get(code, str(code))}
    if result >= 0:
        return {"allowed": True, "errno": None}
    code = ctypes.get_errno()
    return {"allowed": False, "errno": errno.errorcode.get(code, str(code))}


def _io_uring_setup() -> int:
    params = ctypes.create_string_buffer(120)  # struct io_uring_params, zeroed
    fd = _libc.syscall(IO_URING_SETUP, 1, params)
    if fd >= 0:
        os.close(fd)
    return fd


def _vsock() -> int:
    socket.socket(AF_VSOCK, socket.SOCK_STREAM).close()
    return 0


def _seccomp_mode() -> str:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("Seccomp:"):
                return line.split(":", 1)[1].strip()
    return "unknown"


@tool
def probe_kernel() -> str:
    """Call what our seccomp profile refuses and read the kernel's version; report as JSON."""
    with open("/proc/version") as version:
        kernel = version.read().strip()
    return json.dumps(
        {
            "io_uring_setup": _answer(_io_uring_setup),
            "unshare_user": _answer(lambda: _libc.unshare(CLONE_NEWUSER)),
            "ptrace": _answer(lambda: _libc.ptrace(PTRACE_TRACEME, 0, 0, 0)),
            "vsock": _answer(_vsock),
            "clone3": _answer(lambda: _libc.syscall(CLONE3, 0, 0)),
            "seccomp": _seccomp_mode(),
            "proc_version": kernel,
            "machine": platform.machine(),
        }
    )


def build(model):
    return CodeAgent(tools=[probe_kernel], model=model, max_steps=2)
