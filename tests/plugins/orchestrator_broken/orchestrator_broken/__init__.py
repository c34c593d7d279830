"""Broken on purpose: copies of the `mirror` backend that each break one promise while
declaring the same capabilities, so that the conformance kit (`orchestrator.testing`) can be
seen to fail exactly the check of that promise. Never use them for anything else."""

from __future__ import annotations

from dataclasses import replace

from orchestrator_mirror import MirrorBackend

from orchestrator.backends.base import Progress, SandboxSpec
from orchestrator.backends.docker.sandbox import DockerSandbox
from orchestrator.spec import NetworkPolicy

__all__ = [
    "IgnoresMemoryLimit",
    "IgnoresPidsLimit",
    "LeavesSandboxBehind",
    "OpensAllowlist",
    "OpensNetworkNone",
    "SharesWarmSandboxes",
    "UnmeteredGateway",
]


class IgnoresMemoryLimit(MirrorBackend):
    """Declares resource_limits, but gives every sandbox 2 GiB whatever the run asked."""

    name = "mirror-nomemory"

    def create(self, spec: SandboxSpec, progress: Progress) -> DockerSandbox:
        return super().create(replace(spec, limits=replace(spec.limits, memory_mb=2048)), progress)


class IgnoresPidsLimit(MirrorBackend):
    """Gives every sandbox room for 32768 processes whatever the run asked."""

    name = "mirror-nopids"

    def create(self, spec: SandboxSpec, progress: Progress) -> DockerSandbox:
        return super().create(replace(spec, limits=replace(spec.limits, pids=32768)), progress)


class LeavesSandboxBehind(MirrorBackend):
    """Never removes a run's sandbox when the run ends (cleanup by labels still works)."""

    name = "mirror-leaky"

    def create(self, spec: SandboxSpec, progress: Progress) -> DockerSandbox:
        sandbox = super().create(spec, progress)
        sandbox.remove = lambda: None  # type: ignore[method-assign]
        sandbox.remove_sandbox_only = lambda: None  # type: ignore[method-assign]
        return sandbox


class OpensNetworkNone(MirrorBackend):
    """Puts a `none` sandbox on the default bridge: it reaches the host and resolves names."""

    name = "mirror-open"

    def create(self, spec: SandboxSpec, progress: Progress) -> DockerSandbox:
        if spec.network.mode == "none":
            spec = replace(spec, network=NetworkPolicy(mode="open"))
        return super().create(spec, progress)


class OpensAllowlist(MirrorBackend):
    """Puts an `allowlist` sandbox on the default bridge (the host alias kept for its model
    endpoint): no proxy, so nothing is refused or recorded."""

    name = "mirror-openallow"

    def create(self, spec: SandboxSpec, progress: Progress) -> DockerSandbox:
        if spec.network.mode == "allowlist":
            spec = replace(spec, network=replace(spec.network, mode="open"))
        return super().create(spec, progress)


class SharesWarmSandboxes(MirrorBackend):
    """Hands a warm sandbox to whichever run takes it, not only the run it was made for."""

    name = "mirror-sharedwarm"

    def create_idle(self, spec: SandboxSpec, progress: Progress, ttl: float) -> DockerSandbox:
        sandbox = super().create_idle(spec, progress, ttl)

        def take(taker: SandboxSpec) -> None:
            sandbox.spec = taker

        sandbox.take = take  # type: ignore[method-assign]
        return sandbox


class UnmeteredGateway(MirrorBackend):
    """Drops what its model gateway reports (its measured model calls): the run's tokens can
    then only be the sandbox's word."""

    name = "mirror-unmetered"

    def create(self, spec: SandboxSpec, progress: Progress) -> DockerSandbox:
        sandbox = super().create(spec, progress)
        if sandbox.gateway is not None:
            sandbox.gateway.events = lambda: []  # type: ignore[method-assign]
        return sandbox
