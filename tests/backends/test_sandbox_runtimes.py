"""Which sandbox runtimes a run may name is its backend's (`Capabilities.sandbox_runtimes`):
a plugin offers its own (a Kubernetes RuntimeClass such as kata), and each backend refuses
the others' with the names it has."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator import RunSpec, run
from orchestrator.backends import backend_capabilities
from orchestrator.backends.base import (
    Backend,
    Capabilities,
    Progress,
    Sandbox,
    SandboxInfo,
    SandboxSpec,
    check_sandbox_runtime,
)
from orchestrator.defaults import check
from orchestrator.errors import ConfigError, ManifestError
from orchestrator.payloads.manifest import load_manifest
from tests.conftest import TEST_PAYLOADS, cli, write_payload


class KataBackend(Backend):
    """A backend offering a runtime of its own; only its name and capabilities are used."""

    name = "kata-test"
    capabilities = Capabilities(sandbox_runtimes=("kata",))

    def prepare_image(self, extra_requirements: tuple[str, ...], progress: Progress) -> str:
        raise NotImplementedError

    def create(self, spec: SandboxSpec, progress: Progress) -> Sandbox:
        raise NotImplementedError

    def list_sandboxes(self, labels: dict[str, str]) -> list[SandboxInfo]:
        raise NotImplementedError

    def remove_sandbox(self, info: SandboxInfo) -> None:
        raise NotImplementedError


def test_the_built_in_backends_offer_what_they_always_had() -> None:
    assert backend_capabilities("docker").sandbox_runtimes == ("runsc", "runc", "runsc-direct")
    assert backend_capabilities("e2b").sandbox_runtimes == ()


def test_a_backend_accepts_its_own_runtime_and_auto() -> None:
    backend = KataBackend()
    backend.check_runtime("kata")
    backend.check_runtime("auto")
    with pytest.raises(ConfigError) as refused:
        backend.check_runtime("runsc")
    assert refused.value.exit_code == 2
    assert "Unknown sandbox runtime 'runsc' for the kata-test backend." in str(refused.value)
    assert refused.value.fix == "Use one of auto, kata."


def test_docker_refuses_another_backends_runtime_naming_its_own() -> None:
    docker = backend_capabilities("docker")
    with pytest.raises(ConfigError) as refused:
        check_sandbox_runtime("docker", docker, "kata", asked=False)  # the machine's, too
    assert "Unknown sandbox runtime 'kata' for the docker backend." in str(refused.value)
    assert refused.value.fix == "Use one of auto, runsc, runc, runsc-direct."
    with pytest.raises(ConfigError, match="did you mean `runsc`"):
        check_sandbox_runtime("docker", docker, "runs")


def test_a_backend_without_a_choice_ignores_the_machines_and_refuses_the_runs() -> None:
    e2b = backend_capabilities("e2b")
    check_sandbox_runtime("e2b", e2b, "runsc", asked=False)  # meant for another backend
    with pytest.raises(ConfigError, match="has no choice of sandbox runtime"):
        check_sandbox_runtime("e2b", e2b, "runsc", asked=True)


def test_files_and_variables_take_any_runtime_name_and_refuse_what_is_none(
    tmp_path: Path,
) -> None:
    """Which names exist is the run's backend's; the files check the form only."""
    assert check("sandbox_runtime", "kata", "$ORCHESTRATOR_SANDBOX_RUNTIME") == "kata"
    with pytest.raises(ConfigError, match="Use auto or a sandbox runtime"):
        check("sandbox_runtime", "Kata Containers", "$ORCHESTRATOR_SANDBOX_RUNTIME")
    manifest = (
        '[payload]\nname = "p"\nentrypoint = "agent:run"\nsandbox_runtime = "{}"\n'
        "[python]\nrequirements = []\n"
    )
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    kata = load_manifest(write_payload(tmp_path / "a", manifest.format("kata")))
    assert kata.sandbox_runtime == "kata"
    with pytest.raises(ManifestError, match="sandbox_runtime"):
        load_manifest(write_payload(tmp_path / "b", manifest.format("run sc")))


@pytest.mark.docker
def test_a_run_on_docker_naming_another_backends_runtime_is_refused_before_anything(
    docker_client, no_leftovers
) -> None:
    from orchestrator.backends.docker import DockerBackend

    with pytest.raises(ConfigError) as refused:
        run(
            RunSpec(payload=TEST_PAYLOADS / "kernel_probe", sandbox_runtime="kata"),
            backend=DockerBackend(),
        )
    assert refused.value.exit_code == 2 and refused.value.field == "sandbox_runtime"
    assert "Use one of auto, runsc, runc, runsc-direct." in refused.value.fix
    done = cli("run", str(TEST_PAYLOADS / "kernel_probe"), "--sandbox-runtime", "runs")
    assert done.returncode == 2, done.stderr
    assert "did you mean `runsc`?" in done.stderr and "auto, runsc, runc" in done.stderr
