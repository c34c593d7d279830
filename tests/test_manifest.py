"""Manifest validation: every mistake is named with its file, field and what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.errors import ConfigError, ManifestError
from orchestrator.manifest import load_manifest
from orchestrator.models import parse_model
from orchestrator.runner import prepare
from orchestrator.spec import RunSpec

from .conftest import PAYLOADS, TEST_PAYLOADS, write_payload

GOOD = """
[payload]
name = "demo"
entrypoint = "agent:build"
example_task = "hi"

[python]
authorized_imports = ["json", "math"]

[secrets]
required = ["DEMO_TOKEN"]

[network]
hosts = ["api.example.com", "*.wikipedia.org"]

[limits]
max_steps = 4
timeout_seconds = 30

[mock.scripts]
manager = ["Thought: done\\n<code>\\nfinal_answer(1)\\n</code>"]
"""


def test_good_manifest_loads(tmp_path: Path) -> None:
    m = load_manifest(write_payload(tmp_path, GOOD))
    assert m.name == "demo"
    assert m.secrets == ("DEMO_TOKEN",)
    assert m.hosts == ("api.example.com", "*.wikipedia.org")
    assert m.limits.max_steps == 4 and m.limits.memory_mb == 1024
    assert m.payload_files().keys() == {"manifest.toml", "agent.py"}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (('name = "demo"', 'name = "Demo Agent!"'), "payload.name"),
        (('entrypoint = "agent:build"', 'entrypoint = "agent"'), "payload.entrypoint"),
        (('entrypoint = "agent:build"', 'entrypoint = "missing:build"'), "payload.entrypoint"),
        (("max_steps = 4", "max_steps = 0"), "max_steps"),
        (("max_steps = 4", 'max_steps = "four"'), "limits.max_steps"),
        (('"*.wikipedia.org"', '"http://x.org/path"'), "network.hosts"),
        (('["DEMO_TOKEN"]', '["NOT VALID"]'), "secrets.required"),
        (("[limits]", "[limits]\nbogus = 1"), "limits.bogus"),
        (("[network]", "[netwrok]"), "netwrok"),
        (
            ('authorized_imports = ["json", "math"]', 'authorized_imports = "json"'),
            "python.authorized_imports",
        ),
    ],
)
def test_bad_manifest_names_file_and_field(
    tmp_path: Path, change: tuple[str, str], field: str
) -> None:
    folder = write_payload(tmp_path, GOOD.replace(*change))
    with pytest.raises(ManifestError) as info:
        load_manifest(folder)
    message = str(info.value)
    assert str(folder / "manifest.toml") in message
    assert field in message


def test_invalid_toml_is_reported(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="not valid TOML"):
        load_manifest(write_payload(tmp_path, "[payload\nname="))


def test_missing_manifest(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="No payload manifest"):
        load_manifest(tmp_path)


@pytest.mark.parametrize(
    "module", ["os", "subprocess", "os.path", "sys", "importlib", "pickle", "*"]
)
def test_dangerous_imports_refused_without_override(tmp_path: Path, module: str) -> None:
    text = (
        GOOD.replace('["json", "math"]', f'["json", "{module}"]')
        .replace('[secrets]\nrequired = ["DEMO_TOKEN"]', "")
        .replace('hosts = ["api.example.com", "*.wikipedia.org"]', "hosts = []")
    )
    folder = write_payload(tmp_path, text)
    with pytest.raises(ManifestError, match="i-understand-dangerous-imports"):
        prepare(RunSpec(payload=folder))
    prepared = prepare(RunSpec(payload=folder, allow_dangerous_imports=True))
    assert module in prepared.manifest.authorized_imports


def test_unknown_provider() -> None:
    with pytest.raises(ConfigError, match="Unknown model provider 'gpt5'"):
        parse_model("gpt5:turbo")


def test_provider_credentials() -> None:
    assert parse_model("openai:gpt-4o").credential_env == "OPENAI_API_KEY"
    assert parse_model("hf:Qwen/Qwen2.5").credential_env == "HF_TOKEN"
    assert parse_model("mock").credential_env is None
    local = parse_model("openai:llama", api_base="http://127.0.0.1:8080/v1")
    assert local.endpoint == ("127.0.0.1", 8080)


def test_missing_secret_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DEMO_TOKEN", raising=False)
    monkeypatch.chdir(tmp_path)
    folder = write_payload(tmp_path, GOOD)
    with pytest.raises(ConfigError, match="DEMO_TOKEN"):
        prepare(RunSpec(payload=folder, network="open"))


def test_secret_from_dotenv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DEMO_TOKEN", raising=False)
    folder = write_payload(tmp_path, GOOD)
    env_file = tmp_path / "custom.env"
    env_file.write_text("DEMO_TOKEN=from-dotenv-123\nOTHER=not-shipped\n")
    prepared = prepare(RunSpec(payload=folder, network="open", env_file=env_file))
    assert prepared.secrets == {"DEMO_TOKEN": "from-dotenv-123"}


def test_network_defaults_to_allowlist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Declared hosts mean `allowlist` by default (issue 3); `open` only when named."""
    monkeypatch.setenv("DEMO_TOKEN", "x" * 8)
    folder = write_payload(tmp_path, GOOD)
    assert prepare(RunSpec(payload=folder)).network.mode == "allowlist"
    assert prepare(RunSpec(payload=folder, network="open")).network.mode == "open"


def test_at_least_two_example_payloads() -> None:
    assert len([p for p in PAYLOADS.iterdir() if (p / "manifest.toml").is_file()]) >= 2


@pytest.mark.parametrize("folder", sorted(p for p in PAYLOADS.iterdir() if p.is_dir()))
def test_example_payloads_are_valid(folder: Path) -> None:
    m = load_manifest(folder)
    assert m.example_task and m.example_answer
    assert not m.dangerous_imports()
    assert m.mock_scripts


def test_test_payloads_are_valid() -> None:
    for folder in TEST_PAYLOADS.iterdir():
        if (folder / "manifest.toml").is_file():
            load_manifest(folder)


def test_backend_comes_from_the_run_then_the_manifest_then_docker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from orchestrator.backends import backend_name

    monkeypatch.setenv("DEMO_TOKEN", "token-value")
    folder = write_payload(tmp_path, GOOD.replace('example_task = "hi"', 'backend = "e2b"'))
    manifest = load_manifest(folder)
    assert manifest.backend == "e2b"
    assert backend_name(None, manifest) == "e2b"
    assert backend_name("docker", manifest) == "docker"
    assert backend_name(None, load_manifest(PAYLOADS / "research_team")) == "docker"
    assert prepare(RunSpec(payload=folder, task="x")).backend == "e2b"
    with pytest.raises(ConfigError, match="Unknown backend 'k8s'"):
        backend_name("k8s", manifest)
    bad = write_payload(tmp_path, GOOD.replace('example_task = "hi"', 'backend = "lambda"'))
    with pytest.raises(ManifestError, match="payload.backend") as info:
        load_manifest(bad)
    assert "docker, e2b" in info.value.fix
