"""The agent image and payload images, against the real Docker engine."""

from __future__ import annotations

import io
import shutil
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import docker
import docker.errors
import pytest

from orchestrator.backends.docker import base_image, egress, prune
from orchestrator.backends.docker import images as docker_images
from orchestrator.errors import ImageBuildError, OrchestratorError
from orchestrator.images import imagedef, wheelhouse
from orchestrator.labels import LABEL_KIND, LABEL_VERSION
from orchestrator.paths import VERSION
from tests.derived_images import MCP_PIN

pytestmark = pytest.mark.docker

#: Checks run inside the image, read-only and unprivileged: exits non-zero with a reason.
CHECK_IMAGE = r"""
import importlib.util, os, shutil, subprocess, sys

problems = []
for module in ("pip", "setuptools", "ensurepip"):
    if importlib.util.find_spec(module) is not None:
        problems.append(f"module {module} is importable")
for tool in ("pip", "pip3", "apt", "apt-get", "dpkg", "gcc", "cc"):
    if shutil.which(tool):
        problems.append(f"{tool} is on PATH")
for top in ("/usr", "/bin", "/sbin", "/opt"):
    for folder, _, files in os.walk(top):
        for name in files:
            path = os.path.join(folder, name)
            if not os.path.islink(path) and os.stat(path).st_mode & 0o6000:
                problems.append(f"setuid/setgid: {path}")
for root in ("/opt/venv", "/opt/orchestrator"):
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                source = os.path.join(folder, name)
                if not os.path.exists(importlib.util.cache_from_source(source)):
                    problems.append(f"no .pyc for {source}")
modules = sys.argv[1:]
verbose = subprocess.run(
    [sys.executable, "-v", "-c", "import " + ", ".join(modules)],
    capture_output=True, text=True,
)
if verbose.returncode != 0:
    problems.append("import failed: " + verbose.stderr[-2000:])
loaded = [line for line in verbose.stderr.splitlines() if line.startswith("# code object from")]
compiled = [line for line in loaded if not line.rstrip("'").endswith(".pyc")]
problems += [f"compiled at import time: {line}" for line in compiled]
if len(loaded) < 100:
    problems.append(f"only {len(loaded)} modules loaded: {verbose.stderr[-2000:]}")
print("\n".join(problems[:40]) or f"ok: {len(loaded)} modules, all from .pyc")
sys.exit(1 if problems else 0)
"""


def run_in_image(client: docker.DockerClient, image: str, command: list[str]) -> tuple[int, str]:
    """Run `command` hardened as a sandbox would be (read-only root, uid 10001, no network,
    no capabilities); returns (exit code, output). The container is always removed."""
    api = client.api
    container = api.create_container(
        image,
        command=command,
        user="10001:10001",
        network_disabled=True,
        labels={LABEL_KIND: "test"},
        host_config=api.create_host_config(
            read_only=True,
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            network_mode="none",
        ),
    )
    try:
        api.start(container)
        status = api.wait(container, timeout=120)["StatusCode"]
        return status, api.logs(container).decode(errors="replace")
    finally:
        api.remove_container(container, force=True)


class Recorder:
    """A progress callback that keeps every message."""

    def __init__(self) -> None:
        self.messages: list[str] = []

    def __call__(self, message: str) -> None:
        self.messages.append(message)

    def saw(self, text: str) -> bool:
        return any(text in message for message in self.messages)


@pytest.fixture
def no_rebuild(monkeypatch: pytest.MonkeyPatch, docker_client) -> Iterator[None]:
    """Fails any attempt to call pip, run a probe container or build an image."""

    def refuse(*args, **kwargs):
        raise AssertionError("expected everything to be cached")

    monkeypatch.setattr(wheelhouse, "_download_wheelhouse", refuse)
    monkeypatch.setattr(docker_images, "build_image", refuse)
    monkeypatch.setattr(base_image, "bootstrap_base", refuse)
    monkeypatch.setattr(docker_client.containers, "run", refuse)
    yield


def test_agent_image_is_content_addressed_and_labelled(docker_client, agent_image: str):
    assert agent_image.startswith(f"{docker_images.AGENT_IMAGE}:")
    info = docker_client.api.inspect_image(agent_image)
    labels = info["Config"]["Labels"]
    assert labels[LABEL_KIND] == docker_images.KIND_AGENT
    assert labels[LABEL_VERSION] == VERSION
    assert labels[docker_images.LABEL_CONTENT_HASH].startswith(agent_image.split(":")[1])
    assert labels[docker_images.LABEL_BASE_ID].startswith("sha256:")
    assert labels[docker_images.LABEL_PYTHON].startswith("3.")


def test_agent_image_config_is_hardened(docker_client, agent_image: str):
    config = docker_client.api.inspect_image(agent_image)["Config"]
    assert config["User"] == "10001:10001"
    assert config["User"].split(":")[0] not in ("", "0", "root")
    assert config["WorkingDir"] == "/tmp"
    assert config["Cmd"] == ["python", "-m", "orchestrator_runtime"]
    env = dict(item.split("=", 1) for item in config["Env"])
    assert env["PATH"].startswith("/opt/venv/bin:")
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"
    assert env["PYTHONUNBUFFERED"] == "1"
    assert env["HOME"] == "/tmp"


def test_agent_image_runs_read_only_from_bytecode(docker_client, agent_image: str):
    """No pip, package manager or compiler; everything imports from shipped .pyc files."""
    status, output = run_in_image(
        docker_client,
        agent_image,
        ["python", "-c", CHECK_IMAGE, "smolagents", "openai", "orchestrator_runtime"],
    )
    assert status == 0, output
    status, output = run_in_image(docker_client, agent_image, ["id", "-u"])
    assert (status, output.strip()) == (0, "10001")


def test_second_ensure_does_not_rebuild(docker_client, agent_image: str, no_rebuild):
    image_id = docker_client.api.inspect_image(agent_image)["Id"]
    progress = Recorder()
    started = time.perf_counter()
    again = docker_images.ensure_agent_image(docker_client, progress=progress)
    elapsed = time.perf_counter() - started
    assert again == agent_image
    assert docker_client.api.inspect_image(again)["Id"] == image_id
    assert not progress.saw("building") and not progress.saw("resolving wheels")
    print(f"cached ensure_agent_image: {elapsed * 1000:.0f} ms")
    assert elapsed < 2.0  # typically ~15 ms; generous for a loaded machine


def test_payload_image_adds_a_requirement_and_is_cached(
    docker_client, agent_image: str, monkeypatch: pytest.MonkeyPatch
):
    progress = Recorder()
    tag = docker_images.ensure_agent_image(
        docker_client, extra_requirements=["tabulate"], progress=progress
    )
    assert tag.startswith(f"{docker_images.PAYLOAD_IMAGE}:")
    labels = docker_client.api.inspect_image(tag)["Config"]["Labels"]
    assert labels[LABEL_KIND] == docker_images.KIND_PAYLOAD
    assert labels[docker_images.LABEL_AGENT_IMAGE] == agent_image
    assert labels[docker_images.LABEL_REQUIREMENTS] == "tabulate"
    assert docker_client.api.inspect_image(tag)["Config"]["User"] == "10001:10001"

    status, output = run_in_image(
        docker_client, tag, ["python", "-c", CHECK_IMAGE, "tabulate", "smolagents"]
    )
    assert status == 0, output

    # The same requirements, written differently, are the same image, built no more.
    def refuse(*args, **kwargs):
        raise AssertionError("expected the payload image to be cached")

    monkeypatch.setattr(wheelhouse, "_download_wheelhouse", refuse)
    monkeypatch.setattr(docker_images, "build_image", refuse)
    again = docker_images.ensure_agent_image(
        docker_client, extra_requirements=["  tabulate ", "tabulate  # twice"]
    )
    assert again == tag


def test_requirements_the_agent_image_has_need_no_payload_image(docker_client, agent_image: str):
    progress = Recorder()
    tag = docker_images.ensure_agent_image(
        docker_client, extra_requirements=["requests"], progress=progress
    )
    assert tag == agent_image and not progress.saw("building")


#: What a program with `smolagents[mcp]` imports, run in its derived image: the versions.
MCP_IMPORTS = (
    "import importlib.metadata as m\n"
    "from mcp import StdioServerParameters\n"
    "from mcp.server.fastmcp import FastMCP\n"
    "from mcpadapt.core import MCPAdapt\n"
    "from smolagents import MCPClient, ToolCollection\n"
    "print(m.version('mcp'), m.version('mcpadapt'), m.version('smolagents'))\n"
)


@pytest.mark.parametrize(
    ("pin", "constrained"),
    [((), True), ((MCP_PIN,), False)],
    ids=["constrained", "pinned"],
)
def test_smolagents_extras_import_together_and_a_pin_wins_over_the_constraint(
    docker_client, agent_image: str, pin: tuple[str, ...], constrained: bool
):
    """`smolagents[mcp]` at the image's version: the newest mcp and mcpadapt do not import
    together, so images/agent/constraints.txt bounds mcp (the build says so, and the image's
    label keeps it: read here, so an image built before, by scripts/test.sh say, is not built
    again to be read); a payload's own pin of mcp wins over it."""
    from orchestrator.payloads.program import image_smolagents

    version = image_smolagents()
    requirements = [f"smolagents[mcp]=={version}", *pin]
    progress = Recorder()
    tag = docker_images.ensure_agent_image(
        docker_client, extra_requirements=requirements, progress=progress
    )
    assert tag.startswith(f"{docker_images.PAYLOAD_IMAGE}:")
    said = "constraint mcp<2 applied (images/agent/constraints.txt: "
    if progress.saw(f"building {tag}"):  # built here: what the build said
        assert progress.saw(said) == constrained, progress.messages
    labels = docker_client.api.inspect_image(tag)["Config"]["Labels"]
    assert labels[docker_images.LABEL_CONSTRAINTS] == ("mcp<2" if constrained else "")
    status, output = run_in_image(docker_client, tag, ["python", "-c", MCP_IMPORTS])
    assert status == 0, output
    mcp, _, smolagents = output.split()
    assert smolagents == version  # the image's own, not replaced
    assert mcp == MCP_PIN.split("==")[1] if pin else mcp.split(".")[0] == "1", output


def test_runtime_change_changes_the_tag(
    docker_client, agent_image: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_rebuild
):
    runtime = tmp_path / "orchestrator_runtime"
    shutil.copytree(
        docker_images.RUNTIME_DIR, runtime, ignore=shutil.ignore_patterns("__pycache__")
    )
    monkeypatch.setattr(docker_images, "RUNTIME_DIR", runtime)
    assert docker_images.plan_agent_image(docker_client).tag == agent_image

    (runtime / "__pycache__").mkdir(exist_ok=True)  # bytecode caches do not count
    (runtime / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"junk")
    assert docker_images.plan_agent_image(docker_client).tag == agent_image

    init = runtime / "__init__.py"
    init.write_text(init.read_text() + "\n# changed\n")
    changed = docker_images.plan_agent_image(docker_client).tag
    assert changed != agent_image and changed.startswith(f"{docker_images.AGENT_IMAGE}:")


def test_a_base_tag_moved_to_another_image_changes_the_agent_image(docker_client, agent_image: str):
    """The base's id comes from the one inspection that found the base (no second look):
    that id is today's, so a base tag moved to another image changes the agent image's tag
    (never the old image reused)."""
    base = f"orchestrator-test/moved-base:{time.monotonic_ns()}"
    first_id = docker_client.api.inspect_image(base_image.BASE_IMAGE)["Id"]
    docker_client.api.tag(base_image.BASE_IMAGE, *base.split(":"))
    try:
        assert base_image.resolved_base(docker_client, base) == (base, first_id)
        before = docker_images.plan_agent_image(docker_client, base=base)
        assert before.base_id == first_id
        docker_client.api.tag(agent_image, *base.split(":"), force=True)  # same Python
        moved_id = docker_client.api.inspect_image(agent_image)["Id"]
        after = docker_images.plan_agent_image(docker_client, base=base)
        assert after.base_id == moved_id != first_id
        assert after.tag != before.tag
    finally:
        docker_client.api.remove_image(base, noprune=True)


def test_unavailable_base_falls_back_and_says_so(docker_client, agent_image: str):
    """The fallback is said as what it is on a host without a registry, the designed path
    (before: "base image ... is not available (pull failed...); falling
    back to ...", which read like a failure), with the pull's error last."""
    missing = "orchestrator-test/no-such-base:never"
    progress = Recorder()
    assert base_image.resolve_base(docker_client, missing, progress) == base_image.BASE_IMAGE
    said = (
        f"{missing} cannot be pulled here, so images are built on {base_image.BASE_IMAGE}, "
        "the Debian base orchestrator makes itself: the designed path on a host without a "
        "registry (set ORCHESTRATOR_BASE_IMAGE to choose a base; pull failed: "
    )
    assert progress.saw(said)
    assert not progress.saw("not available") and not progress.saw("falling back")
    # The failed pull is remembered: the next call does not try again.
    again = Recorder()
    assert base_image.resolve_base(docker_client, missing, again) == base_image.BASE_IMAGE
    assert not again.saw("pulling") and again.saw(f"note: {missing} cannot be pulled here")


def test_bootstrap_base_explains_what_is_missing(docker_client, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(base_image.shutil, "which", lambda name: None)
    with pytest.raises(OrchestratorError) as error:
        base_image.bootstrap_base(docker_client, tag="orchestrator-test/base:never")
    assert "debootstrap" in error.value.cause and "apt-get install debootstrap" in error.value.fix

    monkeypatch.setattr(base_image.shutil, "which", lambda name: f"/usr/sbin/{name}")
    monkeypatch.setattr(base_image.os, "geteuid", lambda: 1000)
    with pytest.raises(OrchestratorError) as error:
        base_image.bootstrap_base(docker_client, tag="orchestrator-test/base:never")
    assert "root" in error.value.cause and imagedef.BASE_IMAGE_ENV in error.value.fix


def test_failed_build_reports_the_last_lines(docker_client, monkeypatch: pytest.MonkeyPatch):
    dockerfile = f"FROM {base_image.BASE_IMAGE}\nRUN echo about to fail && false\n"
    progress = Recorder()
    with pytest.raises(ImageBuildError) as error:
        docker_images.build_image(
            docker_client,
            "orchestrator-test/broken:never",
            {"Dockerfile": dockerfile.encode()},
            {},
            {},
            progress,
        )
    assert "about to fail" in error.value.cause and "returned a non-zero code" in error.value.cause
    assert progress.saw("build: about to fail")


def _fake_image(client: docker.DockerClient, tag: str, labels: dict[str, str]) -> str:
    """A tiny imported image with `labels`, standing in for an old orchestrator image."""
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w") as tar:
        info = tarfile.TarInfo("marker")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"ok"))
    repository, _, version = tag.rpartition(":")
    changes = [f"LABEL {key}={value}" for key, value in labels.items()]
    client.api.import_image_from_data(
        data.getvalue(), repository=repository, tag=version, changes=changes
    )
    return tag


def test_list_and_prune(docker_client, agent_image: str, monkeypatch: pytest.MonkeyPatch):
    old = _fake_image(
        docker_client,
        f"{docker_images.AGENT_IMAGE}:test0000old0",
        {LABEL_KIND: docker_images.KIND_AGENT, LABEL_VERSION: "0.0.0"},
    )
    old_egress = _fake_image(
        docker_client,
        f"{egress.EGRESS_IMAGE}:test0000old0",
        {LABEL_KIND: egress.KIND_EGRESS_IMAGE, LABEL_VERSION: "0.0.0"},
    )
    current_egress = egress.ensure_egress_image(docker_client)
    # An untagged image of ours (as a rebuild under the same tag leaves one): prune removes it.
    untagged_tag = f"{docker_images.AGENT_IMAGE}:test0000dngl"
    _fake_image(docker_client, untagged_tag, {LABEL_KIND: docker_images.KIND_AGENT, "n": "1"})
    untagged = docker_client.api.inspect_image(untagged_tag)["Id"]
    _fake_image(docker_client, untagged_tag, {LABEL_KIND: docker_images.KIND_AGENT, "n": "2"})
    untagged_name = f"<none> ({untagged.removeprefix('sha256:')[:12]})"
    try:
        assert untagged in prune.dangling_images(docker_client)
        rows = {row["tag"]: row for row in prune.list_images(docker_client)}
        assert rows[agent_image]["kind"] == docker_images.KIND_AGENT
        assert rows[old]["kind"] == docker_images.KIND_AGENT and rows[old]["in_use"] is False
        assert rows[base_image.BASE_IMAGE]["kind"] == base_image.KIND_BASE
        assert {"tag", "id", "kind", "created", "size", "in_use"} <= set(rows[old])

        assert rows[old_egress]["kind"] == egress.KIND_EGRESS_IMAGE
        would = prune.prune_images(docker_client, dry_run=True)
        assert old in would and old_egress in would and untagged_name in would
        assert agent_image not in would and base_image.BASE_IMAGE not in would
        assert current_egress not in would
        assert docker_client.api.inspect_image(old)  # dry run: still there

        # Remove for real, but only among our own images: the engine may hold other
        # sessions' images, which a test must not touch.
        mine = {old, old_egress, agent_image, current_egress, base_image.BASE_IMAGE}
        real_list = prune.list_images
        monkeypatch.setattr(
            prune, "list_images", lambda c: [r for r in real_list(c) if r["tag"] in mine]
        )
        real_dangling = prune.dangling_images
        monkeypatch.setattr(
            prune, "dangling_images", lambda c: [i for i in real_dangling(c) if i == untagged]
        )
        assert sorted(prune.prune_images(docker_client)) == sorted([old, old_egress, untagged_name])
        for gone in (old, old_egress, untagged):
            with pytest.raises(docker.errors.ImageNotFound):
                docker_client.api.inspect_image(gone)
        assert docker_client.api.inspect_image(current_egress)
        assert docker_client.api.inspect_image(agent_image)
        assert docker_client.api.inspect_image(base_image.BASE_IMAGE)
    finally:
        for tag in (old, old_egress, untagged_tag, untagged):
            try:
                docker_client.api.remove_image(tag, force=True)
            except docker.errors.ImageNotFound:
                pass


def test_a_multi_stage_build_reports_its_steps_and_leaves_no_dangling_image(
    docker_client, agent_image: str
) -> None:
    """The classic builder leaves each earlier stage's last image untagged (a
    `<none>` image of hundreds of MB per payload image); build_image removes it. The stage is
    marked with a label of this test, so other builds on the engine cannot blur the count."""
    marker = f"test-{time.time_ns()}"
    dockerfile = (
        f"FROM {agent_image} AS build\n"
        f"LABEL orchestrator.test-stage={marker}\n"
        "RUN echo built > /tmp/made\n"
        f"FROM {agent_image}\n"
        "COPY --from=build /tmp/made /tmp/made\n"
        f"LABEL orchestrator.test-final={marker}\n"
    )
    tag = f"orchestrator-test-stages:{marker}"

    def dangling() -> list[dict]:
        label = f"orchestrator.test-stage={marker}"
        return docker_client.api.images(filters={"dangling": True, "label": label})

    before = len(dangling())
    progress = Recorder()
    try:
        docker_images.build_image(
            docker_client, tag, {"Dockerfile": dockerfile.encode()}, {}, {}, progress
        )
        assert docker_client.api.inspect_image(tag)
        assert len(dangling()) == before == 0
        # The stage's own image is gone, not just untagged elsewhere.
        assert not docker_client.api.images(filters={"label": f"orchestrator.test-stage={marker}"})
        steps = [m for m in progress.messages if m.startswith(f"building {tag}: step ")]
        assert [m.split(" step ")[1].split(" ")[0] for m in steps] == [
            f"{n}/6" for n in range(1, 7)
        ]
        assert all(" after " in m and " s: " in m for m in steps)
        assert progress.saw("build: Step 3/6 : RUN echo built")  # the builder's own, for -v
    finally:
        for image in dangling():
            docker_client.api.remove_image(image["Id"], force=True)
        try:
            docker_client.api.remove_image(tag, force=True)
        except docker.errors.ImageNotFound:
            pass


def test_a_bootstrapped_base_is_tagged_by_its_suite(
    docker_client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`images bootstrap-base --suite trixie` makes the interceptor's base, not a trixie
    tree under the bookworm tag the agent image falls back to (debootstrap missing: the
    error names the tag it would have made)."""
    from orchestrator.backends.docker.backend import DockerBackend

    monkeypatch.setattr(base_image.shutil, "which", lambda name: None)
    backend = DockerBackend(docker_client)
    for suite, tag in (("bookworm", base_image.BASE_IMAGE), ("trixie", "orchestrator-base:trixie")):
        with pytest.raises(OrchestratorError) as error:
            backend.bootstrap_base(
                suite=suite, mirror="http://deb.debian.org/debian", progress=print
            )
        assert f"Cannot make the base image {tag}:" in error.value.cause
