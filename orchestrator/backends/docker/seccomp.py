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
then falls back to `clone`), as in Docker's profile.

Under gVisor (`runsc`, registered with `--oci-seccomp` by setup-gvisor.sh) gVisor applies the
profile to the sandbox's processes, in front of its own kernel: two layers. It reads the
profile by its own names for the system calls, and the runsc this project meets (Debian's
0.0~20221219) differs from Linux in two ways that `gvisor_profile` makes up for:
- its name for `pselect6` is `pselect`: without that alias Python's `select.select` (glibc
  calls pselect6) is refused;
- it ignores `errnoRet`: every refusal answers EPERM, so the `clone3` rule would make the C
  library's thread creation fail (it falls back to `clone` only on ENOSYS). `clone3` is
  allowed instead: this gVisor does not implement it and answers ENOSYS itself, so the flags
  are still checked on `clone`. tests/backends/docker/test_sandbox_kernel.py checks both
  answers under gVisor, so a runsc that implements `clone3` fails that test rather than open the
  door.
System calls this gVisor does not know by name (openat2, landlock_*, futex_waitv, ...) answer
EPERM instead of its ENOSYS: refused either way.
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


#: The profile's name in the record of a gVisor sandbox (`gvisor_profile`).
GVISOR_PROFILE_NAME = f"{PROFILE_NAME}, applied by gVisor"
#: gVisor's own names for system calls it names differently from Linux (see above).
GVISOR_ALIASES = {"pselect6": "pselect"}


def security_options() -> list[str]:
    """`security_opt` of every container we start: no privilege gain through setuid
    binaries, and our seccomp profile."""
    return ["no-new-privileges:true", f"seccomp={profile_text()}"]


@cache
def gvisor_profile_text() -> str:
    """The profile as gVisor applies it (its aliases added; `clone3` left to gVisor's own
    ENOSYS, since it ignores `errnoRet`), as compact JSON."""
    profile = json.loads(PROFILE_PATH.read_text())
    for rule in profile["syscalls"]:
        if rule["names"] == ["clone3"]:
            rule["action"] = "SCMP_ACT_ALLOW"
            rule.pop("errnoRet", None)
            rule["comment"] = "gVisor answers ENOSYS itself (it ignores errnoRet)"
        aliases = [GVISOR_ALIASES[n] for n in rule["names"] if n in GVISOR_ALIASES]
        rule["names"] = [*rule["names"], *aliases]
    return json.dumps(profile, separators=(",", ":"))


def gvisor_security_options() -> list[str]:
    """`security_opt` of a sandbox on gVisor whose runsc applies seccomp filters."""
    return ["no-new-privileges:true", f"seccomp={gvisor_profile_text()}"]
