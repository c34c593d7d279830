"""The secret interceptor as its image runs it: built offline on the debootstrapped trixie
base (mitmproxy 12, Python 3.13), started as a hardened container on a network of the test's
own, configured through its attached stdin, between a client on this host and a real HTTPS
server with its own CA (reached at the network's gateway). Runs use it as
tests/backends/docker/test_secret_runs.py shows.
"""

from __future__ import annotations

import json
import secrets
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker.errors
import pytest
import requests

from orchestrator.backends.docker import prune
from orchestrator.backends.docker.base_image import KIND_BASE, debian_base
from orchestrator.backends.docker.interceptor import (
    CONFDIR,
    INTERCEPTOR_IMAGE,
    INTERCEPTOR_SUITE,
    KIND_INTERCEPTOR_IMAGE,
    Interceptor,
    Ready,
    ensure_interceptor_image,
    injections,
    refusals,
)
from orchestrator.backends.docker.seccomp import security_options
from orchestrator.labels import LABEL_KIND, LABEL_VERSION
from orchestrator.payloads.binding import BoundSecret, SecretBinding
from tests.backends.docker.test_images import _fake_image
from tests.conftest import wait_for
from tests.https_upstream import Upstream, https_upstream

VALUE = "real-secret-value-c0ntainer-4d2e"
PLACEHOLDER = "orchestrator-placeholder-ANALYTICS_TOKEN-9e8d7c6b5a"
NAMES = ["api.example.com", "other.example.net"]

pytestmark = pytest.mark.docker


def _progress(message: str) -> None:
    print(message)


@pytest.fixture(scope="module")
def interceptor_image(docker_client: docker.DockerClient) -> str:
    """Built once per machine (content-addressed): later sessions only hash and inspect."""
    return ensure_interceptor_image(docker_client, _progress)


@pytest.fixture
def network(docker_client: docker.DockerClient, store_label: str) -> Iterator[tuple[str, str]]:
    """A bridge network of this test's own: (its name, this host's address on it)."""
    name = f"orchestrator-test-icpt-{secrets.token_hex(4)}"
    labels = dict([store_label.split("=", 1)])
    created = docker_client.api.create_network(name, driver="bridge", labels=labels)
    try:
        ipam = docker_client.api.inspect_network(created["Id"])["IPAM"]["Config"][0]
        yield name, ipam["Gateway"]
    finally:
        docker_client.api.remove_network(created["Id"])


@pytest.fixture
def running(
    docker_client: docker.DockerClient,
    interceptor_image: str,
    network: tuple[str, str],
    store_label: str,
    tmp_path: Path,
) -> Iterator[tuple[Interceptor, Ready, Upstream, Path]]:
    """The interceptor's container, listening, with its upstream (the test's HTTPS server
    behind a stand-in for squid); removed after the test, and checked gone."""
    name, host_address = network
    with https_upstream(tmp_path, NAMES, address=host_address) as (upstream, upstream_ca):
        interceptor = Interceptor.start(
            docker_client,
            run_id=f"test-{secrets.token_hex(4)}",
            network_name=name,
            labels=dict([store_label.split("=", 1)]),
            image=interceptor_image,
            stop_at=time.time() + 300,
        )
        try:
            binding = SecretBinding("ANALYTICS_TOKEN", ("api.example.com",))
            interceptor.configure(
                {
                    "upstream_proxy": f"http://{host_address}:{upstream.proxy_port}",
                    "upstream_ca_pem": upstream_ca.read_text(),
                    "bindings": [BoundSecret(binding, PLACEHOLDER, VALUE).interceptor_config()],
                }
            )
            ready = interceptor.wait_ready()
            ca_cert = tmp_path / "run-ca.crt"
            ca_cert.write_text(ready.ca_pem)
            yield interceptor, ready, upstream, ca_cert
        finally:
            interceptor.remove()
    with pytest.raises(docker.errors.NotFound):
        docker_client.api.inspect_container(interceptor.container_id)


def _get(ready: Ready, ca_cert: Path, url: str) -> requests.Response:
    proxy = f"http://{ready.address}"
    return requests.get(
        url,
        headers={"X-Api-Key": PLACEHOLDER},
        proxies={"https": proxy, "http": proxy},
        verify=str(ca_cert),
        timeout=30,
    )


def test_the_container_injects_for_its_host_and_refuses_elsewhere(
    docker_client: docker.DockerClient,
    running: tuple[Interceptor, Ready, Upstream, Path],
) -> None:
    """Through the container's port on the test's network: the bound host gets the value
    (checked at the server), another host gets a 403 and nothing arrives there; the host
    reads both decisions back from the container's output."""
    interceptor, ready, upstream, ca_cert = running
    assert ready.address.startswith(f"{interceptor.ip}:")

    injected = _get(ready, ca_cert, "https://api.example.com/data")
    assert injected.status_code == 200, injected.text
    arrived = [r for r in upstream.requests if r["host"] == "api.example.com"]
    assert [r["headers"].get("X-Api-Key") for r in arrived] == [VALUE]
    assert VALUE not in injected.text  # the echo is scrubbed back to the placeholder
    assert PLACEHOLDER in injected.text

    refused = _get(ready, ca_cert, "https://other.example.net/steal")
    assert refused.status_code == 403
    assert refused.headers["x-orchestrator-refused"] == "secret_not_bound"
    assert not [r for r in upstream.requests if r["host"] == "other.example.net"]

    wait_for(lambda: refusals(interceptor.output()), timeout=10)
    assert [(i["secret"], i["host"], i["place"]) for i in injections(interceptor.output())] == [
        ("ANALYTICS_TOKEN", "api.example.com", "header:X-Api-Key")
    ]
    [refusal] = refusals(interceptor.output())
    assert (refusal["secret"], refusal["host"]) == ("ANALYTICS_TOKEN", "other.example.net")
    assert VALUE not in interceptor.output()
    assert interceptor.alive() is None


def test_the_container_is_hardened_and_holds_its_ca_key_in_memory_only(
    docker_client: docker.DockerClient,
    interceptor_image: str,
    running: tuple[Interceptor, Ready, Upstream, Path],
    tmp_path: Path,
) -> None:
    """The run's CA key exists only in the container's tmpfs: not in the image's layers,
    not in `docker inspect`; nor is the secret's value. The container runs as the gateway's
    does: runc, our seccomp profile, read-only root, no capability, no log, not root."""
    interceptor, _, _, _ = running
    api = docker_client.api
    key = _exec(docker_client, interceptor.container_id, ["cat", f"{CONFDIR}/mitmproxy-ca.pem"])
    assert "PRIVATE KEY-----" in key
    key_line = key.split("-----\n", 1)[1].splitlines()[0]  # a line of the key's base64
    assert len(key_line) == 64

    inspected = json.dumps(api.inspect_container(interceptor.container_id))
    assert key_line not in inspected and VALUE not in inspected
    assert "PRIVATE KEY" not in inspected

    host = api.inspect_container(interceptor.container_id)["HostConfig"]
    assert host["Runtime"] == "runc" and host["ReadonlyRootfs"]
    assert host["CapDrop"] == ["ALL"] and host["LogConfig"]["Type"] == "none"
    assert host["SecurityOpt"] == security_options()
    assert api.inspect_container(interceptor.container_id)["Config"]["User"] == "10001:10001"
    assert _exec(docker_client, interceptor.container_id, ["id", "-u"]).strip() == "10001"
    init = _exec(docker_client, interceptor.container_id, ["cat", "/proc/1/cmdline"])
    assert init.split("\0")[:4] == ["python3", "-I", "-S", "/opt/interceptor/deadline.py"]
    no_pip = "import importlib.util as u; assert u.find_spec('pip') is None, 'pip'"
    mitmproxy = "import mitmproxy.version as v; print(v.VERSION)"
    for command in (["python3", "-c", no_pip], ["/opt/venv/bin/python", "-c", no_pip]):
        _exec(docker_client, interceptor.container_id, command)  # nothing installs packages
    found = _exec(
        docker_client, interceptor.container_id, ["/opt/venv/bin/python", "-c", mitmproxy]
    )
    assert found.startswith("12.")

    image = api.inspect_image(interceptor_image)
    assert image["Config"]["Labels"][LABEL_KIND] == KIND_INTERCEPTOR_IMAGE
    assert _image_holds(docker_client, interceptor_image, key_line.encode(), tmp_path) == []

    assert interceptor.alive() is None
    api.kill(interceptor.container_id)  # the run's way out is gone: the host is told
    wait_for(lambda: interceptor.alive() is not None, timeout=30)
    assert "secret interceptor stopped" in str(interceptor.alive())


def _exec(client: docker.DockerClient, container_id: str, command: list[str]) -> str:
    exec_id = client.api.exec_create(container_id, command)["Id"]
    output = client.api.exec_start(exec_id).decode()
    assert client.api.exec_inspect(exec_id)["ExitCode"] == 0, output
    return output


def _image_holds(client: docker.DockerClient, image: str, needle: bytes, folder: Path) -> list[str]:
    """The files of the image's layers (`docker save`) that hold `needle` or are mitmproxy's
    CA files."""
    saved = folder / "image.tar"
    with saved.open("wb") as out:
        for chunk in client.images.get(image).save(named=False):
            out.write(chunk)
    found: list[str] = []
    with tarfile.open(saved) as outer:
        for member in outer:
            handle = outer.extractfile(member) if member.isfile() else None
            if handle is None:
                continue
            try:
                layer: Any = tarfile.open(fileobj=handle, mode="r:")
            except tarfile.TarError:
                continue  # the image's configuration and manifests: no layer
            with layer:
                for entry in layer:
                    if "mitmproxy-ca" in entry.name:
                        found.append(entry.name)
                    data = layer.extractfile(entry) if entry.isfile() else None
                    if data is not None and needle in data.read():
                        found.append(entry.name)
    saved.unlink()
    return found


def test_images_list_and_prune_know_the_interceptor_image(
    docker_client: docker.DockerClient, interceptor_image: str
) -> None:
    """`images list` shows the interceptor image and its trixie base; `images prune` would
    remove an old interceptor image and keep the current one (and the base)."""
    old = _fake_image(
        docker_client,
        f"{INTERCEPTOR_IMAGE}:test0000old0",
        {LABEL_KIND: KIND_INTERCEPTOR_IMAGE, LABEL_VERSION: "0.0.0"},
    )
    try:
        rows = {row["tag"]: row for row in prune.list_images(docker_client)}
        assert rows[interceptor_image]["kind"] == KIND_INTERCEPTOR_IMAGE
        assert rows[old]["kind"] == KIND_INTERCEPTOR_IMAGE
        assert rows[debian_base(INTERCEPTOR_SUITE)]["kind"] == KIND_BASE
        would = prune.prune_images(docker_client, dry_run=True)
        assert old in would
        assert interceptor_image not in would and debian_base(INTERCEPTOR_SUITE) not in would
    finally:
        docker_client.api.remove_image(old, force=True)
