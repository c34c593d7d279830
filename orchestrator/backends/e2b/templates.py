"""E2B templates: the agent image's definition built as a template, content-addressed."""

from __future__ import annotations

import contextlib
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock

from ...errors import ConfigError, EngineUnavailable, ImageBuildError
from ...images.wheelhouse import PythonTarget
from ...paths import VERSION, home_dir
from ..base import Progress
from .settings import API_KEY_ENV, BASE_IMAGE_ENV, PYTHON_ENV, E2BSettings, sdk, with_retries

TEMPLATE_PREFIX = "orchestrator-agent"


#: The unprivileged user made by images/agent/harden.sh, and the runtime inside the template.
SANDBOX_USER = "agent"


PYTHON = "/opt/venv/bin/python"


#: The environment of the runtime besides the secrets (as the Docker image's ENV).
RUNTIME_ENV = {
    "PATH": "/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "VIRTUAL_ENV": "/opt/venv",
    "HOME": "/tmp",
    "PYTHONUNBUFFERED": "1",
    "PYTHONDONTWRITEBYTECODE": "1",
}


@dataclass(frozen=True)
class TemplatePlan:
    """What an agent template is made of, and its content-addressed name."""

    name: str
    content_hash: str
    base: str
    target: PythonTarget
    requirements: str
    wheels: dict[str, Path]  # file name -> path in a host wheelhouse
    scripts: dict[str, bytes]  # install.sh, harden.sh
    runtime_files: dict[str, bytes]
    #: The constraints (images/agent/constraints.txt) that bore on the extra requirements'
    #: resolution, as the build says them.
    constraints: tuple[str, ...] = ()


def local_engine_target(image: str) -> PythonTarget:
    """The interpreter of `image` probed on the local Docker engine, when this machine has
    one with the image: optional (the SDK is imported only here; any failure means "cannot
    tell"), so E2B never needs Docker."""
    import docker  # optional: see above

    from ...images.wheelhouse import python_target as probed_target
    from ...images.wheelhouse import run_probe_container

    client = docker.from_env(timeout=30)
    image_id = client.api.inspect_image(image)["Id"]
    return probed_target(
        image,
        image_id,
        lambda: run_probe_container(client, image),
    )


def python_target(settings: E2BSettings, progress: Progress) -> PythonTarget:
    """The interpreter of the template's base, which the wheels must fit.

    Asked of the image itself when the local Docker engine has it (or can pull it); else
    read from `$ORCHESTRATOR_E2B_PYTHON` or from an official `python:3.N` tag (glibc 2.28,
    the floor of current Debian-based images, x86_64 like E2B's hosts).
    """
    explicit = settings.python
    if explicit is None:
        with contextlib.suppress(Exception):  # no SDK, no engine, no such image: fall through
            return local_engine_target(settings.base_image)
        match = re.match(r"^(?:docker\.io/)?(?:library/)?python:(3\.\d+)", settings.base_image)
        explicit = match.group(1) if match else None
    if explicit is None or not re.match(r"^3\.\d+(\.\d+)?$", explicit):
        raise ConfigError(
            f"Cannot tell which Python the E2B base image {settings.base_image} has "
            "(it is not on the local Docker engine, and its tag does not say).",
            f"Set {PYTHON_ENV} to its version (e.g. 3.12), or use an official python:3.N image.",
        )
    progress(f"e2b: building for Python {explicit} (from {settings.base_image})")
    return PythonTarget(version=explicit, glibc="2.28", machine="x86_64")


def plan_template(
    settings: E2BSettings, extra_requirements: tuple[str, ...], progress: Progress
) -> TemplatePlan:
    """The template for a run: the agent environment plus the payload's extra requirements
    (one template per set; E2B has no cheap derived layers to share)."""
    from ...images.constraints import (
        applicable,
        constraints_text,
        read_constraints,
        report_applied,
    )
    from ...images.imagedef import (
        AGENT_IMAGE_DIR,
        RUNTIME_DIR,
        agent_image_definition,
        digest,
        normalize_requirements,
        runtime_files_of,
        sha256,
    )
    from ...images.wheelhouse import ensure_wheelhouse

    target = python_target(settings, progress)
    requirements = (AGENT_IMAGE_DIR / "requirements.txt").read_text()
    agent = ensure_wheelhouse(requirements, target, progress=progress)
    wheels = {name: agent.path / name for name in agent.wheels}
    digests = dict(agent.wheels)
    extra = normalize_requirements(extra_requirements)
    constrained: list[str] = []
    if extra:
        extra_text = "\n".join(extra) + "\n"
        in_force = applicable(extra, read_constraints())
        constraints = constraints_text(agent.pins(), in_force)
        more = ensure_wheelhouse(extra_text, target, constraints=constraints, progress=progress)
        constrained = report_applied(in_force, more.wheels, None)
        wheels |= {name: more.path / name for name in more.wheels}
        digests |= more.wheels
        requirements = requirements.rstrip("\n") + "\n" + extra_text
    definition = agent_image_definition()
    scripts = {name: definition[name] for name in ("install.sh", "harden.sh")}
    runtime = runtime_files_of(RUNTIME_DIR)
    content_hash = digest(
        {
            "version": VERSION,
            "definition": {name: sha256(data) for name, data in definition.items()},
            "requirements": requirements,
            "base": settings.base_image,
            "python": target.version,
            "wheels": digests,
            "runtime": {name: sha256(data) for name, data in runtime.items()},
            "size": [settings.cpus, settings.memory_mb],
        }
    )
    return TemplatePlan(
        name=f"{TEMPLATE_PREFIX}-{content_hash[:12]}",
        content_hash=content_hash,
        base=settings.base_image,
        target=target,
        requirements=requirements,
        wheels=wheels,
        scripts=scripts,
        runtime_files=runtime,
        constraints=tuple(constrained),
    )


def _write_context(plan: TemplatePlan, root: Path) -> None:
    """The files the template copies in, laid out as the Docker build context is."""
    (root / "requirements.txt").write_text(plan.requirements)
    for name, data in plan.scripts.items():
        (root / name).write_bytes(data)
    (root / "wheels").mkdir()
    for name, path in plan.wheels.items():
        shutil.copyfile(path, root / "wheels" / name)
    for name, data in plan.runtime_files.items():
        target = root / "orchestrator_runtime" / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


def template_definition(plan: TemplatePlan, context: Path) -> Any:
    """The E2B template: the Docker image's two stages in one, same scripts, same files."""
    e2b = sdk()
    return (
        e2b.Template(file_context_path=str(context))
        .from_image(plan.base)
        .copy("requirements.txt", "/wheels/")
        .copy("wheels/", "/wheels/")
        .copy("orchestrator_runtime/", "/opt/orchestrator/orchestrator_runtime/")
        .copy("install.sh", "/install.sh")
        .copy("harden.sh", "/harden.sh")
        .run_cmd("sh /install.sh && sh /harden.sh", user="root")
        .set_envs(RUNTIME_ENV)
        .set_workdir("/tmp")
        .set_user(SANDBOX_USER)
    )


def ensure_template(
    settings: E2BSettings,
    extra_requirements: tuple[str, ...] = (),
    progress: Progress = lambda _m: None,
) -> str:
    """The name of a template to run: built only if E2B does not have it yet."""
    e2b = sdk()
    plan = plan_template(settings, extra_requirements, progress)

    def exists() -> bool:
        return bool(
            with_retries(
                settings.attempts,
                lambda: e2b.Template.exists(plan.name, api_key=settings.api_key),
                what="template lookup",
                progress=progress,
            )
        )

    try:
        if exists():
            return plan.name
        locks = home_dir() / "images"
        locks.mkdir(parents=True, exist_ok=True)
        with FileLock(str(locks / f".e2b-{plan.content_hash[:16]}.lock")):
            if exists():
                return plan.name
            _build_template(plan, settings, progress)
    except e2b.AuthenticationException as exc:
        raise EngineUnavailable(
            f"E2B refused the API key ({exc}).", f"Check {API_KEY_ENV}; nothing was started."
        ) from exc
    return plan.name


def _build_template(plan: TemplatePlan, settings: E2BSettings, progress: Progress) -> None:
    e2b = sdk()
    progress(f"e2b: building template {plan.name} on {plan.base} ({plan.target.describe()})")
    for message in plan.constraints:
        progress(f"e2b: {message}")
    started = time.monotonic()
    tail: list[str] = []

    def on_log(entry: Any) -> None:
        message = str(getattr(entry, "message", entry)).rstrip()
        if message:
            tail[:] = [*tail[-24:], message]
            progress(f"e2b build: {message}")

    with tempfile.TemporaryDirectory(prefix="orchestrator-e2b-") as context:
        _write_context(plan, Path(context))
        template = template_definition(plan, Path(context))
        try:
            e2b.Template.build(
                template,
                plan.name,
                cpu_count=settings.cpus,
                memory_mb=settings.memory_mb,
                on_build_logs=on_log,
                api_key=settings.api_key,
            )
        except e2b.AuthenticationException:
            raise
        except Exception as exc:
            raise ImageBuildError(
                f"Building the E2B template {plan.name} failed: {exc}\nLast build output:\n"
                + "\n".join(tail),
                f"Read the build output above for the failing step; check that E2B can pull "
                f"the base image {plan.base} ({BASE_IMAGE_ENV}).",
            ) from exc
    progress(f"e2b: built template {plan.name} in {time.monotonic() - started:.1f} s")
