"""The runsc binary this path drives, and every flag it is given, in one place.

The binary is the one `setup-gvisor.sh` installs (Debian's runsc, on PATH); the engine's
registration of it is not read here: this path runs runsc itself, with its own state root
under the orchestrator's state directory (never the engine's `/var/run/docker/runtime-runc`).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from ....errors import ConfigError
from ....paths import home_dir
from ..runtimes import OCI_SECCOMP, SETUP_SCRIPT

#: Where runsc keeps the state of the containers this path runs (`--root`), under the state
#: directory. Short, since runsc names sockets after paths below it.
ROOT_DIR = "runsc/root"

#: The global flags of every runsc call, each with why. Changing one changes every
#: snapshot's key (`snapshot.key`): a checkpoint restores only into the runsc that made it.
GLOBAL_FLAGS: tuple[tuple[str, str], ...] = (
    # gVisor applies the OCI spec's seccomp filter (our profile) to the sandbox's own
    # processes: two layers, gVisor's kernel and the filter in front of it.
    (OCI_SECCOMP, "our seccomp profile inside gVisor"),
    # The run's cgroup is made by us (cgroup.py) and runsc is started inside it, so that
    # the OOM kill count can be read after runsc removed its container: runsc leaves
    # cgroups alone.
    ("--ignore-cgroups", "the run's own cgroup is ours (cgroup.py)"),
)


#: The network flag of each kind of sandbox (`runsc(..., network=...)`), each with why.
NETWORK_FLAGS: dict[str, tuple[str, str]] = {
    # No network stack at all: only loopback inside gVisor; the kind snapshots are made of.
    "none": ("--network=none", "sandboxes without network"),
    # The network namespace the spec names (a holder container's on the run's Docker
    # network, direct.py) used through the host's stack, as the engine's `runsc-net` does:
    # this runsc's own stack does not start. gVisor cannot checkpoint it: such sandboxes
    # start cold.
    "holder": ("--network=host", "sandboxes on the run's network, in a holder's namespace"),
}


def runsc_path() -> str:
    """The runsc on PATH. Raises ConfigError when there is none."""
    found = shutil.which("runsc")
    if found is None:
        raise ConfigError(
            "--sandbox-runtime runsc-direct runs gVisor's runsc itself, and there is no "
            "`runsc` on PATH.",
            f"Set gVisor up once, as root: `bash {SETUP_SCRIPT}` (installs Debian's runsc), "
            "or choose --sandbox-runtime runsc (through the engine) or runc.",
        )
    return found


def state_root() -> Path:
    """runsc's `--root` for this state directory (made on demand)."""
    root = home_dir() / ROOT_DIR
    root.mkdir(parents=True, exist_ok=True)
    return root


def runsc(*args: str, network: str = "none") -> list[str]:
    """The argv of one runsc call: the binary, `--root`, GLOBAL_FLAGS, the `network` kind's
    flag (NETWORK_FLAGS), then `args`."""
    flags = [flag for flag, _ in GLOBAL_FLAGS]
    return [runsc_path(), f"--root={state_root()}", *flags, NETWORK_FLAGS[network][0], *args]


def spawn(argv: list[str]) -> subprocess.Popen[bytes]:
    """Start `argv` (a `runsc` call, joined to its cgroup) with its stdio our pipes, in
    runsc's state root and a session of its own: a Ctrl-C at the terminal reaches the
    orchestrator, which decides; never runsc, which would forward it into the sandbox.
    Raises OSError when it cannot start."""
    return subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        close_fds=True,
        cwd=state_root(),
    )
