"""Secrets bound to hosts (`[secrets.bind]`): what a binding may say, refused with file, line
and field before anything starts; and, on a backend that cannot keep a bound secret out of
the sandbox (E2B) or without an allowlist, a run with bindings refused (exit 2) rather than
run with the value inside. The runs themselves: tests/backends/docker/test_secret_runs.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.errors import ConfigError, ManifestError
from orchestrator.lifecycle.runner import prepare
from orchestrator.payloads.binding import SecretBinding, bind_secrets
from orchestrator.payloads.manifest import load_manifest
from orchestrator.policy import host_covered
from orchestrator.spec import RunSpec
from tests.conftest import cli, write_payload

BOUND = """
[payload]
name = "bound"
entrypoint = "agent:build"
example_task = "hi"

[secrets]
required = ["ANALYTICS_TOKEN", "OTHER_TOKEN"]

[secrets.bind]
ANALYTICS_TOKEN = { hosts = ["api.example.com"], in = ["header"] }

[network]
hosts = ["api.example.com", "*.example.org"]
"""


def line_of(text: str, needle: str) -> int:
    return next(n for n, line in enumerate(text.splitlines(), 1) if needle in line)


def test_a_binding_is_read_with_its_defaults(tmp_path: Path) -> None:
    text = BOUND.replace(
        'in = ["header"] }',
        'in = ["header", "query"] }\n'
        'OTHER_TOKEN = { hosts = ["*.eu.example.org", "A.example.org"] }',
    )
    manifest = load_manifest(write_payload(tmp_path, text))
    assert manifest.bindings == (
        SecretBinding("ANALYTICS_TOKEN", ("api.example.com",), ("header", "query")),
        SecretBinding("OTHER_TOKEN", ("*.eu.example.org", "a.example.org"), ("header",)),
    )
    assert manifest.secrets == ("ANALYTICS_TOKEN", "OTHER_TOKEN")


@pytest.mark.parametrize(
    ("binding", "field", "said"),
    [
        ('{ hosts = ["evil.example.net"] }', "secrets.bind.ANALYTICS_TOKEN.hosts", "allowlist"),
        ('{ hosts = ["example.org"] }', "secrets.bind.ANALYTICS_TOKEN.hosts", "allowlist"),
        ('{ hosts = ["*.example.com"] }', "secrets.bind.ANALYTICS_TOKEN.hosts", "allowlist"),
        ('{ hosts = ["93.184.216.34"] }', "secrets.bind.ANALYTICS_TOKEN.hosts", "IP address"),
        ('{ hosts = ["[::1]"] }', "secrets.bind.ANALYTICS_TOKEN.hosts", "IP address"),
        ('{ hosts = ["localhost"] }', "secrets.bind.ANALYTICS_TOKEN.hosts", "this machine"),
        ("{ hosts = [] }", "secrets.bind.ANALYTICS_TOKEN.hosts", "is empty"),
        ('{ in = ["header"] }', "secrets.bind.ANALYTICS_TOKEN.hosts", "is missing"),
        (
            '{ hosts = ["api.example.com"], in = ["cookie"] }',
            "secrets.bind.ANALYTICS_TOKEN.in",
            "header, query, body",
        ),
        ('{ hosts = ["api.example.com"], in = [] }', "secrets.bind.ANALYTICS_TOKEN.in", "empty"),
        (
            '{ hosts = ["api.example.com"], where = ["header"] }',
            "secrets.bind.ANALYTICS_TOKEN.where",
            "not a known field",
        ),
        ('"api.example.com"', "secrets.bind.ANALYTICS_TOKEN", "must be a table"),
    ],
)
def test_a_bad_binding_names_file_line_and_field(
    tmp_path: Path, binding: str, field: str, said: str
) -> None:
    text = BOUND.replace('{ hosts = ["api.example.com"], in = ["header"] }', binding)
    folder = write_payload(tmp_path, text)
    with pytest.raises(ManifestError) as info:
        load_manifest(folder)
    assert [p.field for p in info.value.problems] == [field]
    cause = info.value.cause
    assert cause.startswith(f"{folder / 'manifest.toml'}:{line_of(text, 'ANALYTICS_TOKEN =')}:")
    assert f"`{field}`" in cause and said in f"{cause} {info.value.fix}", cause
    assert info.value.exit_code == 2


def test_every_problem_of_every_binding_at_once(tmp_path: Path) -> None:
    text = BOUND.replace(
        '{ hosts = ["api.example.com"], in = ["header"] }',
        '{ hosts = ["api.example.net", "10.0.0.1"], in = ["cookie"] }\n'
        'NOPE = { hosts = ["api.example.com"] }',
    )
    with pytest.raises(ManifestError) as info:
        load_manifest(write_payload(tmp_path, text))
    found = [(p.field, p.line) for p in info.value.problems]
    line = line_of(text, "ANALYTICS_TOKEN =")
    assert sorted(found) == [
        ("secrets.bind.ANALYTICS_TOKEN.hosts", line),  # the IP literal
        ("secrets.bind.ANALYTICS_TOKEN.hosts", line),  # api.example.net, not listed
        ("secrets.bind.ANALYTICS_TOKEN.in", line),
        ("secrets.bind.NOPE", line + 1),
    ]


def test_a_secret_not_declared_cannot_be_bound(tmp_path: Path) -> None:
    text = BOUND.replace("ANALYTICS_TOKEN = {", "ANALYTICS_TOKN = {")
    with pytest.raises(ManifestError) as info:
        load_manifest(write_payload(tmp_path, text))
    (problem,) = info.value.problems
    assert problem.field == "secrets.bind.ANALYTICS_TOKN"
    assert "not a secret of `[secrets] required`" in problem.message
    assert "ANALYTICS_TOKEN, OTHER_TOKEN" in problem.message


def test_passthrough_is_read_and_checked_like_the_allowlist(tmp_path: Path) -> None:
    """`[network] passthrough`: names or patterns of the allowlist; a secret cannot be bound
    to a host whose TLS is relayed unread (exit 2, the file, line and field named)."""
    listed = BOUND + 'passthrough = ["Pinned.example.org", "*.eu.example.org"]\n'
    manifest = load_manifest(write_payload(tmp_path, listed))
    assert manifest.passthrough == ("pinned.example.org", "*.eu.example.org")
    assert load_manifest(write_payload(tmp_path, BOUND)).passthrough == ()

    for entry, field, said in [
        ('"10.0.0.1"', "network.passthrough", "IP address"),
        ('"elsewhere.example.net"', "network.passthrough", "not on the allowlist"),
        ('"api.example.com"', "secrets.bind.ANALYTICS_TOKEN.hosts", "relays unread"),
        ('"*.example.org"', "secrets.bind.OTHER_TOKEN.hosts", "relays unread"),
    ]:
        text = BOUND.replace(
            '{ hosts = ["api.example.com"], in = ["header"] }',
            '{ hosts = ["api.example.com"], in = ["header"] }\n'
            'OTHER_TOKEN = { hosts = ["a.example.org"] }',
        )
        text += f"passthrough = [{entry}]\n"
        folder = write_payload(tmp_path, text)
        with pytest.raises(ManifestError) as info:
            load_manifest(folder)
        assert [p.field for p in info.value.problems] == [field], info.value.problems
        cause = info.value.cause
        line = line_of(text, field.split(".")[2] + " =" if "bind" in field else "passthrough")
        assert cause.startswith(f"{folder / 'manifest.toml'}:{line}:"), cause
        assert f"`{field}`" in cause and said in f"{cause} {info.value.fix}", cause
        assert info.value.exit_code == 2


def test_a_programs_binding_is_checked_like_a_manifests(tmp_path: Path) -> None:
    program = tmp_path / "report.py"
    program.write_text(
        "# /// script\n"
        '# dependencies = ["smolagents>=1.20"]\n'
        "# [tool.orchestrator.secrets]\n"
        '# required = ["ANALYTICS_TOKEN"]\n'
        "# [tool.orchestrator.secrets.bind]\n"
        '# ANALYTICS_TOKEN = { hosts = ["api.example.net"] }\n'
        "# [tool.orchestrator.network]\n"
        '# hosts = ["api.example.com"]\n'
        "# ///\n"
        "print('hi')\n"
    )
    with pytest.raises(ManifestError) as info:
        load_manifest(program)
    (problem,) = info.value.problems
    assert problem.field == "tool.orchestrator.secrets.bind.ANALYTICS_TOKEN.hosts"
    assert problem.line == 6 and "api.example.net" in problem.message
    program.write_text(program.read_text().replace("api.example.net", "api.example.com"))
    assert load_manifest(program).bindings == (
        SecretBinding("ANALYTICS_TOKEN", ("api.example.com",)),
    )


@pytest.mark.parametrize(
    ("host", "allowlist", "covered"),
    [
        ("api.example.com", ["api.example.com"], True),
        ("api.example.com", ["*.example.com"], True),
        ("a.b.example.com", ["*.example.com"], True),
        ("example.com", ["*.example.com"], False),  # a pattern is not its apex
        ("*.example.com", ["*.example.com"], True),
        ("*.eu.example.com", ["*.example.com"], True),
        ("*.example.com", ["api.example.com", "www.example.com"], False),
        ("*.example.com", ["example.com"], False),
        ("notexample.com", ["*.example.com"], False),
        ("api.example.com.evil.net", ["api.example.com"], False),
    ],
)
def test_which_hosts_an_allowlist_covers(host: str, allowlist: list[str], covered: bool) -> None:
    assert host_covered(host, allowlist) is covered


def test_a_run_with_bindings_is_refused_where_the_value_would_enter_the_sandbox(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """E2B has no interceptor on its sandboxes' egress: a bound secret would be in the
    sandbox's environment, so the run is refused before anything starts (fail closed); so
    is `--network open` anywhere (a way out past the interceptor)."""
    monkeypatch.setenv("ANALYTICS_TOKEN", "real-value")
    monkeypatch.setenv("OTHER_TOKEN", "other-value")
    folder = write_payload(tmp_path, BOUND)
    with pytest.raises(ConfigError) as info:
        prepare(RunSpec(payload=folder, backend="e2b"))
    error = info.value
    assert error.exit_code == 2 and error.field == "payload"
    assert str(folder / "manifest.toml") in error.cause
    assert "ANALYTICS_TOKEN -> api.example.com (header)" in error.cause
    assert "not available on the e2b backend" in error.cause
    assert "Nothing was started" in error.cause
    assert "real-value" not in str(error)
    with pytest.raises(ConfigError) as info:
        prepare(RunSpec(payload=folder, network="open"))
    assert info.value.exit_code == 2 and info.value.field == "network"
    assert "needs the allowlist" in info.value.cause and "real-value" not in str(info.value)
    unbound = BOUND.replace(
        'ANALYTICS_TOKEN = { hosts = ["api.example.com"], in = ["header"] }', ""
    )
    prepared = prepare(RunSpec(payload=write_payload(tmp_path, unbound), backend="e2b"))
    assert prepared.secrets["ANALYTICS_TOKEN"] == "real-value"  # today's path, unchanged


def test_docker_binds_where_the_allowlist_applies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On Docker a bound run is prepared with its bindings (its interceptor's), the bound
    secret not among those inside; under `none` nothing leaves, so no interceptor (the
    placeholder alone is inside), and a check (`validate`) ships placeholders anyway."""
    monkeypatch.setenv("ANALYTICS_TOKEN", "real-value")
    monkeypatch.setenv("OTHER_TOKEN", "other-value")
    folder = write_payload(tmp_path, BOUND)
    prepared = prepare(RunSpec(payload=folder, backend="docker"))
    assert [b.name for b in prepared.bindings] == ["ANALYTICS_TOKEN"]
    assert prepared.secrets_inside == ("OTHER_TOKEN",)
    assert prepare(RunSpec(payload=folder, network="none")).bindings == ()
    assert prepare(RunSpec(payload=folder, check_only=True)).bindings == ()


def test_validate_says_what_run_says(tmp_path: Path) -> None:
    folder = write_payload(
        tmp_path, BOUND.replace('hosts = ["api.example.com"], in', 'hosts = ["10.1.2.3"], in')
    )
    out = cli("validate", str(folder), "--no-load")
    assert out.returncode == 2 and out.stdout == "", out.stderr
    assert "`secrets.bind.ANALYTICS_TOKEN.hosts` has an entry '10.1.2.3'" in out.stderr
    assert "IP address" in out.stderr
    write_payload(tmp_path, BOUND)
    env = {"ANALYTICS_TOKEN": "v1", "OTHER_TOKEN": "v2"}
    out = cli("validate", str(folder), "--no-load", "--json", env=env)
    assert out.returncode == 0, out.stdout + out.stderr  # Docker binds secrets
    out = cli("validate", str(folder), "--no-load", "--json", "--backend", "e2b", env=env)
    assert out.returncode == 2, out.stderr
    problems = json.loads(out.stdout)["problems"]
    assert len(problems) == 1, problems
    assert "binding secrets to hosts is not available on the e2b backend" in problems[0]


def test_each_run_gets_fresh_placeholders_and_the_value_stays_outside() -> None:
    bindings = (SecretBinding("ANALYTICS_TOKEN", ("api.example.com",)),)
    values = {"ANALYTICS_TOKEN": "real-value-123", "OTHER_TOKEN": "unbound-value"}
    sandbox, bound = bind_secrets(values, bindings)
    again, _ = bind_secrets(values, bindings)
    (secret,) = bound
    assert sandbox["OTHER_TOKEN"] == "unbound-value"  # unbound: today's path
    assert sandbox["ANALYTICS_TOKEN"] == secret.placeholder != again["ANALYTICS_TOKEN"]
    assert secret.placeholder.startswith("orchestrator-bound-ANALYTICS_TOKEN-")
    assert "real-value-123" not in json.dumps(sandbox) and "real-value-123" not in repr(secret)
    assert secret.interceptor_config() == {
        "name": "ANALYTICS_TOKEN",
        "placeholder": secret.placeholder,
        "value": "real-value-123",
        "hosts": ["api.example.com"],
        "in": ["header"],
    }
    assert bind_secrets({}, bindings) == ({}, ())  # no values read (schedule validation)


def test_the_record_and_the_start_line_say_which_secrets_are_inside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unbound secret goes into the sandbox, as before; the run says so. The model's key,
    held by the gateway, is not among them."""
    from orchestrator.cli.display import describe_event, network_of

    monkeypatch.setenv("ANALYTICS_TOKEN", "v1")
    monkeypatch.setenv("OTHER_TOKEN", "v2")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    unbound = BOUND.replace(
        'ANALYTICS_TOKEN = { hosts = ["api.example.com"], in = ["header"] }', ""
    )
    folder = write_payload(tmp_path, unbound)
    prepared = prepare(RunSpec(payload=folder, model="openai:gpt-4o"))
    assert prepared.gateway is not None and "OPENAI_API_KEY" in prepared.secret_names
    assert prepared.secrets_inside == ("ANALYTICS_TOKEN", "OTHER_TOKEN")
    keyed = prepare(RunSpec(payload=folder, model="openai:gpt-4o", gateway=False))
    assert keyed.secrets_inside == ("ANALYTICS_TOKEN", "OTHER_TOKEN", "OPENAI_API_KEY")
    created = {
        "type": "sandbox_created",
        "network": "allowlist",
        "allowlist": ["api.example.com"],
        "secrets_inside": list(prepared.secrets_inside),
    }
    line = describe_event(
        {"type": "run_start", "payload": "bound", "agents": [{"name": "manager"}]},
        network=network_of(created),
    )
    assert line == (
        "▶ run started: payload bound · agents manager · network allowlist (api.example.com)"
        " · secrets in the sandbox: ANALYTICS_TOKEN, OTHER_TOKEN"
    )
    assert network_of({**created, "secrets_inside": []}) == "allowlist (api.example.com)"
    bound = {**created, "secrets_inside": ["OTHER_TOKEN"]}
    bound["secrets_bound"] = ["ANALYTICS_TOKEN -> api.example.com (header)"]
    assert network_of(bound) == (
        "allowlist (api.example.com) · secrets in the sandbox: OTHER_TOKEN · secrets bound "
        "(placeholders inside): ANALYTICS_TOKEN -> api.example.com (header)"
    )
