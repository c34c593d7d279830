"""The connection to the local Docker engine."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import docker.errors

from ...errors import EngineUnavailable


def connect() -> docker.DockerClient:
    """A client for the local engine, or a one-paragraph error saying how to get one."""
    try:
        client = docker.from_env(timeout=120)
        client.ping()
    except Exception as exc:  # the SDK raises several types for "no engine"
        raise EngineUnavailable(
            f"Cannot reach the Docker engine ({type(exc).__name__}: {exc}).",
            "Start Docker (`sudo systemctl start docker`, or `dockerd &`), check DOCKER_HOST, "
            "and make sure this user may use the socket (the `docker` group); nothing was "
            "started.",
        ) from exc
    return client


def stopped(client: docker.DockerClient, container_id: str, what: str, then: str) -> str | None:
    """None while a helper container of a run (egress proxy, model gateway) runs; else why
    the run lost it: `what` names it, `then` says what that cost the sandbox. An engine that
    hiccups is not evidence that the container is gone."""
    try:
        state = client.api.inspect_container(container_id)["State"]
    except docker.errors.NotFound:
        return f"the {what} container vanished during the run; {then}"
    except docker.errors.APIError:
        return None
    if state.get("Running"):
        return None
    return f"the {what} stopped during the run (exit code {state.get('ExitCode')}); {then}"


def inspect_image(client: docker.DockerClient, ref: str) -> dict[str, Any] | None:
    try:
        return client.api.inspect_image(ref)
    except docker.errors.ImageNotFound:
        return None


def engine_time(text: str | None) -> float | None:
    """The engine's RFC 3339 times (nanoseconds, `Z`) as epoch seconds; None for Docker's
    zero time or nothing."""
    if not text or text.startswith("0001-"):
        return None
    head, _, rest = text.rstrip("Z").partition(".")
    try:
        return datetime.fromisoformat(f"{head}.{(rest or '0')[:6]:0<6}+00:00").timestamp()
    except ValueError:
        return None
