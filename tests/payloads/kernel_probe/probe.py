"""The sandbox-kernel tests' probe: what the kernel answers to `io_uring_setup`, from a tool
(plain Python, outside the agent's interpreter), and which kernel it is."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import platform

from smolagents import CodeAgent, tool

#: io_uring_setup's number on x86-64 and arm64 (the generic table) alike.
IO_URING_SETUP = 425


def _io_uring_setup() -> dict[str, object]:
    libc = ctypes.CDLL(None, use_errno=True)
    params = ctypes.create_string_buffer(120)  # struct io_uring_params, zeroed
    fd = libc.syscall(IO_URING_SETUP, 1, params)
    if fd >= 0:
        os.close(fd)
        return {"allowed": True, "errno": None}
    code = ctypes.get_errno()
    return {"allowed": False, "errno": errno.errorcode.get(code, str(code))}


@tool
def probe_kernel() -> str:
    """Call io_uring_setup and read the kernel's version; report both as JSON."""
    with open("/proc/version") as version:
        kernel = version.read().strip()
    return json.dumps(
        {"io_uring_setup": _io_uring_setup(), "proc_version": kernel, "machine": platform.machine()}
    )


def build(model):
    return CodeAgent(tools=[probe_kernel], model=model, max_steps=2)
