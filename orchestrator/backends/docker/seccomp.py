"""The seccomp profile of every container we start under runc (`seccomp.json`, package data).

Why our own: the engine's built-in profile is whatever its version shipped. Docker 20.10 (this
project's engine, and many in the field) still allows io_uring, the kernel interface behind
most container escapes of recent years (Google's kCTF VRP, 2023); Docker 25.0 removed it
(moby/moby#46762). With our own profile every engine gets the newer rules.

Origin: moby's `profiles/seccomp/default.json` as of Docker Engine 25.0 (written out by us
for a container without capabilities), with these changes:
- no `io_uring_setup`, `io_uring_enter`, `io_uring_register` (as 25.0; 20.10 allows them);
- `socket(AF_VSOCK)` refused (moby/moby#44562, Docker 23.0 and late 20.10 releases);
- no `ptrace`, `process_vm_readv`, `process_vm_writev` (Docker allows them on kernels from
  4.8): nothing in a sandbox debugs another process, and they were seccomp's blind spot;
- the rules Docker applies only to containers holding a capability (`mount`, `bpf`,
  `perf_event_open`, `unshare`, module loading...) are left out: every container of ours
  drops ALL capabilities, so Docker would not apply them either;
- architectures: x86-64 (with x86 and x32) and arm64 (with arm).

`clone` stays refused with any namespace flag and `clone3` answers ENOSYS (the C library
then falls back to `clone`), as in Docker's profile. Under gVisor (`runsc`) the profile is
not applied by the engine: gVisor's own kernel answers the sandbox's system calls.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

#: The profile's name as the run record gives it (change it with the file).
PROFILE_NAME = "orchestrator-2026.11 (docker default minus io_uring)"
PROFILE_PATH = Path(__file__).with_name("seccomp.json")


@cache
def profile_text() -> str:
    """The profile as compact JSON, the way the engine takes it (`seccomp=<json>`).
    Raises OSError when the package's data file is missing (a broken install)."""
    return json.dumps(json.loads(PROFILE_PATH.read_text()), separators=(",", ":"))


def security_options() -> list[str]:
    """`security_opt` of every container we start: no privilege gain through setuid
    binaries, and our seccomp profile."""
    return ["no-new-privileges:true", f"seccomp={profile_text()}"]
