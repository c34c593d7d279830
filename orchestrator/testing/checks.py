"""The conformance kit's checks: one named check per promise every backend must keep.

Each check is real: a run through the public API (`orchestrator.run`) of the kit's probe
payload (`probe.py`) on the backend under test, or its sandboxes listed through the backend
interface. A check a backend's `Capabilities` honestly declare absent is NOT APPLICABLE,
and says which capability; nothing else is skipped. The pytest plugin (`plugin.py`) and
`orchestrator doctor` run this same list: one list, two front doors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..records.record import MAX_LINE_BYTES
from ..spec import RunResult
from .allowlist import check_allowlist_allowed, check_allowlist_recorded, check_allowlist_refused
from .dead import check_deadline, check_orphans_removed
from .gateway import check_gateway_key_absent, check_gateway_tokens
from .hostnet import Listener, host_addresses
from .kit import SHORT_LIMIT, Check, CheckFailed, Kit
from .runs import check_cancel, check_shipping_size, check_shipping_symlink, check_warm_one_run

#: The link-local address cloud metadata services answer on (AWS, GCP, Azure, ...).
METADATA_ADDRESS = "169.254.169.254"
#: A public name the sandbox must not resolve under `none` (Debian's mirror: this project's
#: machines resolve it, so a sandbox with the host's DNS would too).
OUTSIDE_NAME = "deb.debian.org"


# ---- lifecycle ---------------------------------------------------------------------------


def _two_runs(kit: Kit) -> tuple[RunResult, RunResult]:
    return kit.run("ok-1", "ok"), kit.run("ok-2", "ok")


def check_one_sandbox_per_run(kit: Kit) -> str:
    results = _two_runs(kit)
    ids = []
    for result in results:
        if result.status != "succeeded" or json.loads(str(result.answer)) != "ok":
            raise CheckFailed(f"run {result.run_id} ended {result.status}: {result.error}")
        made = [e for e in kit.events[result.run_id] if e.get("type") == "sandbox_created"]
        if len(made) != 1:
            raise CheckFailed(f"run {result.run_id} made {len(made)} sandboxes, not one")
        ids.append(made[0].get("sandbox_id"))
    if ids[0] == ids[1]:
        raise CheckFailed(f"two runs shared the sandbox {ids[0]}")
    return f"two runs, two sandboxes ({', '.join(str(i)[:12] for i in ids)})"


def check_sandbox_removed(kit: Kit) -> str:
    left = [(r.run_id, info) for r in _two_runs(kit) for info in kit.left_of(r.run_id)]
    if left:
        named = ", ".join(f"{info.kind} {info.name} ({info.state})" for _, info in left)
        raise CheckFailed(
            f"after their runs ended the backend still has: {named}",
            "Remove the sandbox and everything made for it in Sandbox.remove.",
        )
    return "nothing of either run is left on the backend"


# ---- limits ------------------------------------------------------------------------------


def check_time_limit(kit: Kit) -> str:
    result = kit.run("sleep", "sleep", {"seconds": 60}, timeout_seconds=SHORT_LIMIT)
    took = result.timings.get("duration", 0.0)
    if result.status != "timed_out":
        raise CheckFailed(f"a run sleeping past its {SHORT_LIMIT} s limit ended {result.status}")
    if took > SHORT_LIMIT + 5:
        raise CheckFailed(f"timed out, but only after {took:.1f} s (limit {SHORT_LIMIT} s)")
    return f"timed_out after {took:.1f} s"


def check_memory_limit(kit: Kit) -> str:
    result = kit.run("memory", "memory", {"mb": 768}, memory_mb=128, timeout_seconds=60)
    if result.status != "oom_killed" or not result.oom_killed:
        raise CheckFailed(
            f"a run holding 768 MiB under a 128 MiB limit ended {result.status} "
            f"(answer {result.answer!r})",
            "Render SandboxSpec.limits.memory_mb as the sandbox's memory limit, and report an "
            "OOM kill in ExitInfo.oom_killed (or declare resource_limits=False).",
        )
    return "oom_killed under 128 MiB"


def check_pids_limit(kit: Kit) -> str:
    pids, count = 32, 64
    # Memory enough for `count` forked probes where a fork costs little (runc: about 2 MiB),
    # so that what stops them is the process limit, not the memory limit (a backend ignoring
    # pids must be seen): an out-of-memory end is a failure too. gVisor's forks cost more (it
    # copies in larger pieces at copy-on-write); there the process limit is held to what the
    # memory carries, so it still refuses them first.
    result = kit.run(
        "forks", "forks", {"count": count}, pids=pids, memory_mb=1024, timeout_seconds=60
    )
    said = str(kit.answer(result))
    if not said.startswith("fork refused after"):
        raise CheckFailed(
            f"{count} processes started under a limit of {pids}: {said}",
            "Render SandboxSpec.limits.pids as the sandbox's process limit.",
        )
    children = int(said.rsplit("after ", 1)[1].split()[0])
    if children >= pids:
        raise CheckFailed(f"{children} children started under a limit of {pids}")
    return f"{said} (limit {pids})"


# ---- the host decides the end ------------------------------------------------------------


def check_forged_end(kit: Kit) -> str:
    result = kit.run("forge", "forge")
    if result.status == "succeeded" or result.answer == "forged":
        raise CheckFailed(
            f"a forged run_end counted: status {result.status}, answer {result.answer!r}",
            "Decide a run's end on the host from what the host saw (runner/outcome), never "
            "from a frame the sandbox wrote.",
        )
    return f"a forged success was not believed: {result.status}"


# ---- the sandbox itself ------------------------------------------------------------------


#: The one line the inspecting run writes on stderr first: longer than the host keeps.
SHOUT_BYTES = MAX_LINE_BYTES + 2**20


def _inspect_run(kit: Kit) -> RunResult:
    """The run that looks around the sandbox (once per kit), shouting one over-long line."""
    return kit.run("inspect", "inspect", {"shout": SHOUT_BYTES})


def _inspected(kit: Kit) -> dict[str, Any]:
    found: dict[str, Any] = kit.answer(_inspect_run(kit))
    return found


def check_unprivileged(kit: Kit) -> str:
    seen = _inspected(kit)
    problems = []
    if seen["uid"] == 0 or seen["euid"] == 0:
        problems.append(f"runs as root (uid {seen['uid']})")
    if seen.get("cap_eff") and int(seen["cap_eff"], 16) != 0:
        problems.append(f"holds capabilities (CapEff {seen['cap_eff']})")
    if seen.get("no_new_privs") not in (None, "1"):
        problems.append("may gain privileges (NoNewPrivs 0)")
    if problems:
        raise CheckFailed(
            "; ".join(problems),
            "Run the sandbox as a non-root user, drop every capability, set no-new-privileges.",
        )
    nnp = seen.get("no_new_privs") or "not reported by this kernel"
    return f"uid {seen['uid']}, CapEff {seen.get('cap_eff')}, NoNewPrivs {nnp}"


def check_read_only_root(kit: Kit) -> str:
    if _inspected(kit)["root_writable"]:
        raise CheckFailed("the sandbox wrote a file at /", "Make the root filesystem read-only.")
    return "writing at / was refused"


def check_no_engine_socket(kit: Kit) -> str:
    seen = _inspected(kit)
    found = list(seen["engine_sockets"]) + (
        [f"DOCKER_HOST={seen['docker_host']}"] if seen.get("docker_host") else []
    )
    if found:
        raise CheckFailed(
            f"the sandbox can reach an engine: {', '.join(found)}",
            "Mount no engine socket into the sandbox and pass no DOCKER_HOST.",
        )
    others = seen.get("sockets") or []
    return "no engine socket" + (f" (other sockets: {', '.join(others)})" if others else "")


def host_kernel() -> str:
    with open("/proc/version") as version:
        return version.read().strip()


#: What each refused system call is, in a failure's words.
FILTERED = {
    "io_uring": ("io_uring_setup", "the interface behind most recent container escapes"),
    "ptrace": ("ptrace(PTRACE_TRACEME)", "reading and steering other processes"),
    "vsock": ("socket(AF_VSOCK)", "the way to a VM host's services (moby/moby#44562)"),
}


def _filtered(kit: Kit, probe: str) -> str:
    """The verdict on one system call the sandbox must not reach on the host's kernel:
    refused there, or answered by another kernel (gVisor's, a VM's), whatever it answers."""
    result = _inspect_run(kit)
    seen = _inspected(kit)
    call, why = FILTERED[probe]
    outcome = seen[probe]
    where = ", ".join(f"{k} {v}" for k, v in result.sandbox.items()) or "not said"
    if seen["proc_version"] != host_kernel():
        return (
            f"the sandbox's system calls reach another kernel than the host's "
            f"({seen['proc_version'][:40]}...; {call} there: "
            f"{'allowed' if outcome['allowed'] else 'refused'}); isolation: {where}"
        )
    if outcome["allowed"]:
        raise CheckFailed(
            f"{call} succeeded in the sandbox against the host's own kernel ({why})",
            "Apply orchestrator's seccomp profile (runc) or run on gVisor.",
        )
    return f"{call} refused by the host's kernel ({outcome['errno']}); {where}"


def check_kernel_filtered(kit: Kit) -> str:
    return _filtered(kit, "io_uring")


def check_ptrace_refused(kit: Kit) -> str:
    return _filtered(kit, "ptrace")


def check_vsock_refused(kit: Kit) -> str:
    return _filtered(kit, "vsock")


def check_output_cut(kit: Kit) -> str:
    result = _inspect_run(kit)
    kit.answer(result)
    cuts = [e for e in kit.events_of(result, "output_cut") if e.get("stream") == "stderr"]
    fix = (
        "Stream the sandbox's stdout and stderr into the run's record as they come "
        "(Sandbox.stream), where the host cuts what is too long."
    )
    if not cuts:
        raise CheckFailed(
            f"a {SHOUT_BYTES}-byte line on stderr left no output_cut in the record", fix
        )
    kept = int(cuts[0].get("kept_bytes") or 0)
    log = Path(result.record_dir) / "stderr.log"
    size = log.stat().st_size if log.is_file() else 0
    if kept > MAX_LINE_BYTES or size >= SHOUT_BYTES:
        raise CheckFailed(
            f"a {SHOUT_BYTES}-byte line kept {kept} bytes (cap {MAX_LINE_BYTES}); the "
            f"record's stderr log holds {size} bytes",
            fix,
        )
    return (
        f"a {SHOUT_BYTES}-byte line cut at {kept} bytes ({cuts[0].get('dropped_bytes')} "
        f"dropped, output_cut recorded); stderr log {size} bytes"
    )


# ---- egress under `none` -----------------------------------------------------------------


def _egress_none(kit: Kit) -> dict[str, Any]:
    def make() -> dict[str, Any]:
        listener = Listener()
        addresses = host_addresses()
        try:
            attempts = [{"kind": "tcp", "host": a, "port": listener.port} for a in addresses]
            attempts += [
                {"kind": "tcp", "host": METADATA_ADDRESS, "port": 80},
                {"kind": "dns", "name": OUTSIDE_NAME},
            ]
            answer = kit.answer(kit.run("egress-none", "net", {"attempts": attempts}))
        finally:
            listener.close()
        return {"outcomes": answer, "connections": listener.connections, "port": listener.port}

    found: dict[str, Any] = kit.memo("egress-none-outcomes", make)
    return found


def _reached(kit: Kit, kind: str, host: str | None = None) -> tuple[list[dict[str, Any]], int]:
    seen = _egress_none(kit)
    rows = [o for o in seen["outcomes"] if o["kind"] == kind]
    if host == METADATA_ADDRESS:
        rows = [o for o in rows if o["host"] == METADATA_ADDRESS]
    elif kind == "tcp":
        rows = [o for o in rows if o["host"] != METADATA_ADDRESS]
    return rows, seen["connections"]


EGRESS_FIX = "Give a `none` sandbox no network at all (no bridge, no host route, no DNS)."


def check_egress_host(kit: Kit) -> str:
    rows, connections = _reached(kit, "tcp")
    reached = [o["host"] for o in rows if o["ok"]]
    if reached or connections:
        raise CheckFailed(
            f"under `none` the sandbox reached the host at {', '.join(reached) or '?'} "
            f"({connections} connections arrived at the host's listener)",
            EGRESS_FIX,
        )
    return f"{len(rows)} host addresses unreachable, no connection arrived"


def check_egress_metadata(kit: Kit) -> str:
    rows, _ = _reached(kit, "tcp", METADATA_ADDRESS)
    if any(o["ok"] for o in rows):
        raise CheckFailed(f"under `none` the sandbox reached {METADATA_ADDRESS}:80", EGRESS_FIX)
    return f"{METADATA_ADDRESS}: {rows[0].get('error', 'refused') if rows else 'not tried'}"


def check_egress_dns(kit: Kit) -> str:
    rows, _ = _reached(kit, "dns")
    if any(o["ok"] for o in rows):
        raise CheckFailed(
            f"under `none` the sandbox resolved {OUTSIDE_NAME}: {rows[0].get('addresses')}",
            EGRESS_FIX,
        )
    return f"{OUTSIDE_NAME} did not resolve"


#: The checks of a sandbox that shares this host's kernel (a container): what it may do to
#: that kernel. A backend whose sandboxes run elsewhere (E2B's microVMs, each with a kernel of
#: its own, where the default user may even sudo) is held to its provider's isolation instead.
SHARED_KERNEL = "sandboxes_run=this_host"

CHECKS: tuple[Check, ...] = (
    Check(
        "lifecycle.one_sandbox_per_run",
        "each run gets a fresh sandbox of its own",
        None,
        check_one_sandbox_per_run,
    ),
    Check(
        "lifecycle.sandbox_removed",
        "nothing of a run is left once it ended",
        None,
        check_sandbox_removed,
    ),
    Check(
        "lifecycle.cancel",
        "a run cancelled mid-way ends `cancelled`, its sandbox gone",
        None,
        check_cancel,
    ),
    Check(
        "warm.one_run",
        "a warm sandbox serves the one run it was made for, and goes with it",
        "WarmSandboxes",
        check_warm_one_run,
    ),
    Check(
        "shipping.symlink_out",
        "a payload with a symlink leaving its folder is refused before any sandbox",
        None,
        check_shipping_symlink,
    ),
    Check(
        "shipping.size_cap",
        "a payload over the size cap is refused before any sandbox",
        None,
        check_shipping_size,
    ),
    Check(
        "limits.time",
        "the time limit stops the run and removes its sandbox",
        None,
        check_time_limit,
    ),
    Check(
        "limits.memory",
        "the memory limit holds: over it the run is oom_killed",
        "resource_limits",
        check_memory_limit,
    ),
    Check("limits.pids", "the process limit holds (no fork bomb)", None, check_pids_limit),
    Check(
        "limits.output",
        "an over-long output line is cut, and the cut recorded",
        None,
        check_output_cut,
    ),
    Check(
        "ends.forged_end",
        "the host decides the end: a forged success does not count",
        None,
        check_forged_end,
    ),
    Check(
        "sandbox.unprivileged",
        "not root, no capabilities, no privilege gain",
        SHARED_KERNEL,
        check_unprivileged,
    ),
    Check(
        "sandbox.read_only_root",
        "the sandbox's root filesystem is read-only",
        None,
        check_read_only_root,
    ),
    Check(
        "sandbox.no_engine_socket",
        "no engine socket or DOCKER_HOST in the sandbox",
        None,
        check_no_engine_socket,
    ),
    Check(
        "sandbox.kernel_filtered",
        "the host kernel's io_uring out of reach: refused, or another kernel answers",
        SHARED_KERNEL,
        check_kernel_filtered,
    ),
    Check(
        "sandbox.ptrace_refused",
        "the host kernel's ptrace out of reach: refused, or another kernel answers",
        SHARED_KERNEL,
        check_ptrace_refused,
    ),
    Check(
        "sandbox.vsock_refused",
        "the host kernel's AF_VSOCK out of reach: refused, or another kernel answers",
        SHARED_KERNEL,
        check_vsock_refused,
    ),
    Check(
        "egress.none.host",
        "under `none` the host's addresses are unreachable",
        None,
        check_egress_host,
    ),
    Check(
        "egress.none.metadata",
        f"under `none` {METADATA_ADDRESS} is unreachable",
        None,
        check_egress_metadata,
    ),
    Check("egress.none.dns", "under `none` no outside name resolves", None, check_egress_dns),
    Check(
        "egress.allowlist.allowed",
        "under `allowlist` a listed endpoint is reachable",
        "egress_events",
        check_allowlist_allowed,
    ),
    Check(
        "egress.allowlist.refused",
        "under `allowlist` an unlisted endpoint is refused, nothing arrives there",
        "egress_events",
        check_allowlist_refused,
    ),
    Check(
        "egress.allowlist.recorded",
        "a refused attempt is recorded as `egress_blocked` (host, port)",
        "egress_events",
        check_allowlist_recorded,
    ),
    Check(
        "gateway.key_absent",
        "with a model gateway the model key is nowhere in the sandbox",
        "model_gateway",
        check_gateway_key_absent,
    ),
    Check(
        "gateway.tokens_measured",
        "with a model gateway the record counts its measured tokens, not the sandbox's claim",
        "model_gateway",
        check_gateway_tokens,
    ),
    Check(
        "deadline.orchestrator_killed",
        "a sandbox stops by itself when its orchestrator is SIGKILLed",
        None,
        check_deadline,
    ),
    Check(
        "cleanup.orphans_removed",
        "`cleanup` removes a dead run's sandbox and closes its record",
        None,
        check_orphans_removed,
    ),
)
