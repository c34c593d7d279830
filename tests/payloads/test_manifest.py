"""Manifest validation: every mistake is named with its file, field and what is allowed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.errors import ConfigError, ManifestError
from orchestrator.lifecycle.runner import prepare
from orchestrator.models import parse_model
from orchestrator.payloads.manifest import load_manifest
from orchestrator.registry import backend_names
from orchestrator.spec import RunSpec
from tests.conftest import PAYLOADS, TEST_PAYLOADS, cli, write_payload

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
    """Declared hosts mean `allowlist` by default; `open` only when named."""
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
    assert "docker, e2b" in info.value.fix  # the built-in ones first, then any plugin's


# ---- requirements are package specifications, hosts are DNS names, files UTF-8 ----

REFERENCE = "x @ file:///etc/passwd"


def with_requirements(*requirements: str) -> str:
    """GOOD with these `python.requirements` (JSON strings are TOML strings)."""
    return GOOD.replace("[python]", f"[python]\nrequirements = {json.dumps(requirements)}")


@pytest.mark.parametrize(
    ("requirement", "words"),
    [
        (REFERENCE, "direct reference"),
        ("x @ https://example.com/x-1.0.tar.gz", "direct reference"),
        ("https://example.com/x-1.0-py3-none-any.whl", "URL or path"),
        ("./vendor/x", "URL or path"),
        ("/etc/passwd", "URL or path"),
        ("git+https://example.com/x.git", "URL or path"),
        ("-e .", "pip option"),
        ("--index-url https://example.invalid/simple", "pip option"),
        ("x.whl", "archive file name"),
        ("tabulate # pinned", "not a package specification"),
    ],
)
def test_requirements_must_be_package_specifications(
    tmp_path: Path, requirement: str, words: str
) -> None:
    folder = write_payload(tmp_path, with_requirements(requirement))
    with pytest.raises(ManifestError) as info:
        load_manifest(folder)
    message = str(info.value)
    assert str(folder / "manifest.toml") in message and "python.requirements" in message
    assert repr(requirement) in message and words in message
    assert "--allow-requirement" in message


def test_package_specifications_pass(tmp_path: Path) -> None:
    specs = ("tabulate==0.9.0", "pandas[excel]>=2,<3; python_version >= '3.10'", "Foo_Bar.baz")
    assert load_manifest(write_payload(tmp_path, with_requirements(*specs))).requirements == specs


def test_smolagents_is_the_images_with_the_extras_named(tmp_path: Path) -> None:
    """A manifest's `smolagents[mcp]` is the image's smolagents with the extra's packages;
    a version the image does not have, or an extra smolagents lacks, is refused up front."""
    from orchestrator.payloads.program import image_smolagents

    folder = write_payload(tmp_path, with_requirements("smolagents[mcp]", "smolagents>=1"))
    version = image_smolagents()
    assert load_manifest(folder).requirements == (f"smolagents[mcp]=={version}",)
    (tmp_path / "bad").mkdir()
    bad = write_payload(tmp_path / "bad", with_requirements("smolagents<1", "smolagents[gpu]"))
    with pytest.raises(ManifestError) as info:
        load_manifest(bad)
    message = str(info.value)
    assert "2 problems" in message and "python.requirements" in message
    assert f"the sandbox's image has smolagents {version}" in message
    assert "has no extra 'gpu'" in message and "mcp" in message


def test_a_direct_reference_passes_when_allowed_by_name(tmp_path: Path) -> None:
    from orchestrator.images.imagedef import normalize_requirements
    from orchestrator.policy import AllowedRequirement

    folder = write_payload(tmp_path, with_requirements(REFERENCE, "tabulate"))
    with pytest.raises(ManifestError):
        load_manifest(folder, allowed_requirements=["y @ file:///etc/passwd"])  # not this one
    manifest = load_manifest(folder, allowed_requirements=["x  @  file:///etc/passwd"])
    assert manifest.requirements == (REFERENCE, "tabulate")
    assert isinstance(manifest.requirements[0], AllowedRequirement)
    assert not isinstance(manifest.requirements[1], AllowedRequirement)
    # The image build admits the reference only with the mark the manifest gave it.
    assert normalize_requirements(manifest.requirements) == ("tabulate", REFERENCE)
    with pytest.raises(ConfigError, match="direct reference"):
        normalize_requirements([REFERENCE])
    with pytest.raises(ConfigError, match="pip option"):
        normalize_requirements([AllowedRequirement("--index-url https://example.invalid/")])


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1",
        "0.0.0.0",
        "::1",
        "[::1]",
        "10.1.2.3",
        "127.1",
        "2130706433",
        "localhost",
        "LocalHost",
        "*.localhost",
        "app.localhost",
        "host.docker.internal",
        "*.internal",
    ],
)
def test_hosts_must_be_dns_names(tmp_path: Path, host: str) -> None:
    folder = write_payload(tmp_path, GOOD.replace('"*.wikipedia.org"', f'"{host}"'))
    with pytest.raises(ManifestError) as info:
        load_manifest(folder)
    message = str(info.value)
    assert str(folder / "manifest.toml") in message and "network.hosts" in message
    assert repr(host) in message and "--api-base" in info.value.fix


@pytest.mark.parametrize("host", ["api.example.com", "*.example.org", "1e100.net", "x-1.io"])
def test_dns_names_pass(tmp_path: Path, host: str) -> None:
    manifest = load_manifest(
        write_payload(tmp_path, GOOD.replace('"*.wikipedia.org"', f'"{host}"'))
    )
    assert host in manifest.hosts


def test_manifest_that_is_not_utf8_names_line_and_column(tmp_path: Path) -> None:
    folder = write_payload(tmp_path, GOOD)
    data = GOOD.encode().replace(b'example_task = "hi"', b'example_task = "h\xe9"')  # line 5
    (folder / "manifest.toml").write_bytes(data)
    with pytest.raises(ManifestError) as info:
        load_manifest(folder)
    assert info.value.cause == (
        f"{folder / 'manifest.toml'}: line 5, column 18: byte 0xe9 is not valid UTF-8."
    )
    assert "UTF-8" in info.value.fix


def test_manifest_with_a_byte_order_mark_loads(tmp_path: Path) -> None:
    folder = write_payload(tmp_path, GOOD)
    (folder / "manifest.toml").write_bytes(b"\xef\xbb\xbf" + GOOD.encode())
    assert load_manifest(folder).name == "demo"


# ---- one schema, every problem at once, with its field path and line ---------------

THREE_MISTAKES = GOOD.replace("max_steps = 4", 'max_step = 6\nmemory_mb = "lots"').replace(
    "timeout_seconds = 30", "timeout_seconds = 0"
)


def line_of(text: str, start: str) -> int:
    """The 1-based line of `text` that starts with `start`."""
    return next(n for n, line in enumerate(text.splitlines(), 1) if line.startswith(start))


def test_three_mistakes_are_all_reported_by_one_validate(tmp_path: Path) -> None:
    """Acceptance 3: an unknown key close to a real one, a wrong type, a value out of range:
    one `orchestrator validate` names all three, each with its line, field path and fix."""
    folder = write_payload(tmp_path, THREE_MISTAKES)
    manifest = folder / "manifest.toml"
    out = cli("validate", str(folder), "--no-load")
    assert out.returncode == 2 and out.stdout == "", out.stderr
    assert out.stderr.startswith(f"orchestrator: error: {manifest}: 3 problems:\n"), out.stderr
    expected = [
        (
            line_of(THREE_MISTAKES, "max_step ="),
            "field `limits.max_step` is not a known limit; did you mean `max_steps`? "
            "Known limits: ",
        ),
        (
            line_of(THREE_MISTAKES, "memory_mb"),
            "field `limits.memory_mb` must be an integer, got 'lots'. Use 64 to 65536 MiB.",
        ),
        (
            line_of(THREE_MISTAKES, "timeout_seconds"),
            "field `limits.timeout_seconds` is 0, out of range. Use 1 to 86400 seconds.",
        ),
    ]
    for line, text in expected:
        assert f"\n  - line {line}: {text}" in out.stderr, (line, text, out.stderr)
    # The same through --json: one entry per problem, and each one's path, line and fix.
    report = json.loads(cli("validate", str(folder), "--no-load", "--json").stdout)
    assert not report["ok"] and len(report["problems"]) == 3
    assert [p.split(": ", 1)[0] for p in report["problems"]] == [
        f"{manifest}:{line}" for line, _ in expected
    ]
    assert [(d["field"], d["line"]) for d in report["details"]] == [
        ("limits.max_step", expected[0][0]),
        ("limits.memory_mb", expected[1][0]),
        ("limits.timeout_seconds", expected[2][0]),
    ]
    assert all(d["fix"] for d in report["details"])
    # The Python API says the same: one error, every problem.
    with pytest.raises(ManifestError) as info:
        load_manifest(folder)
    assert [p.field for p in info.value.problems] == [d["field"] for d in report["details"]]


def test_a_misspelled_table_suggests_the_right_one_and_the_rest_is_still_checked(
    tmp_path: Path,
) -> None:
    text = GOOD.replace("[python]", "[pyhton]").replace('name = "demo"', 'name = "Demo!"')
    text = text.replace('"*.wikipedia.org"', '"10.0.0.1"')
    folder = write_payload(tmp_path, text)
    with pytest.raises(ManifestError) as info:
        load_manifest(folder)
    message = info.value.cause
    assert (
        f"line {line_of(text, '[pyhton]')}: `[pyhton]` is not a known section; "
        "did you mean `[python]`?" in message
    )
    assert f"line {line_of(text, 'name =')}: field `payload.name` is 'Demo!'" in message
    assert "field `network.hosts` has an entry '10.0.0.1' that" in message
    assert [p.field for p in info.value.problems] == ["payload.name", "pyhton", "network.hosts"]


def test_one_problem_is_one_sentence_with_its_line_and_own_fix(tmp_path: Path) -> None:
    text = GOOD.replace('example_task = "hi"', 'backend = "lambda"')
    folder = write_payload(tmp_path, text)
    with pytest.raises(ManifestError) as info:
        load_manifest(folder)
    line = line_of(text, "backend")
    assert info.value.cause == (
        f"{folder / 'manifest.toml'}:{line}: field `payload.backend` is 'lambda', "
        f"not one of {', '.join(backend_names())}."
    )
    assert info.value.fix == f"Use one of {', '.join(backend_names())}."


def test_a_missing_entrypoint_is_said_to_be_missing(tmp_path: Path) -> None:
    text = GOOD.replace('entrypoint = "agent:build"\n', "")
    folder = write_payload(tmp_path, text)
    with pytest.raises(ManifestError) as info:
        load_manifest(folder)
    assert "field `payload.entrypoint` is missing." in info.value.cause
    assert "None" not in str(info.value)
    assert "`module:function`" in info.value.fix
    # No [payload] table at all: both of its required fields are missing, each named.
    folder = write_payload(tmp_path, "[python]\nauthorized_imports = []\n")
    with pytest.raises(ManifestError) as info:
        load_manifest(folder)
    assert [p.field for p in info.value.problems] == ["payload.name", "payload.entrypoint"]
    assert all(p.message.endswith("is missing") for p in info.value.problems)


def test_wrong_types_are_named_with_what_was_given(tmp_path: Path) -> None:
    text = GOOD.replace("max_steps = 4", "max_steps = 4.5\ncpus = true").replace(
        '["DEMO_TOKEN"]', '"DEMO_TOKEN"'
    )
    folder = write_payload(tmp_path, text)
    with pytest.raises(ManifestError) as info:
        load_manifest(folder)
    messages = [p.message for p in info.value.problems]
    assert messages == [
        "field `secrets.required` must be a list, got 'DEMO_TOKEN'",
        "field `limits.max_steps` must be a whole number, got 4.5",
        "field `limits.cpus` must be a number, not true/false",
    ]


def test_toml_lines_finds_keys_tables_and_array_elements() -> None:
    from orchestrator.schema import TomlLines

    lines = TomlLines(
        '[payload]\nname = "x"\ndescription = """\nfake = 1\n"""\n'  # 1-5
        "[[schedule]]\ncron = '@daily'\n"  # 6-7
        '[[schedule]]\n"quoted key" = 1\nlimits = { max_steps = 0 }\n'  # 8-10
        "[schedule.notify]\n  webhook.url = 'x'  # a comment\n"  # 11-12
    )
    assert lines.line("payload") == 1 and lines.line("payload.name") == 2
    assert lines.line("payload.fake") == 1  # inside a multi-line string: not a key
    assert lines.line("schedule[1].cron") == 7 and lines.line("schedule[2]") == 8
    assert lines.line("schedule[2].quoted key") == 9
    assert lines.line("schedule[2].limits.max_steps") == 10  # an inline table: its line
    assert lines.line("schedule[2].notify") == 11
    assert lines.line("schedule[2].notify.webhook.url") == 12
    assert lines.line("schedule[3].cron") is None and lines.line("other") is None


def test_a_missing_entrypoint_function_lists_the_functions_that_exist(tmp_path: Path) -> None:
    code = "import json\n\ndef build(model):\n    pass\n\nasync def helper():\n    pass\n\n"
    code += "class Agent:\n    pass\n"
    folder = write_payload(tmp_path, GOOD.replace("agent:build", "agent:biuld"), code)
    out = cli("validate", str(folder), "--no-load")  # read from the source: no sandbox
    assert out.returncode == 2
    assert (
        f"{folder / 'manifest.toml'}: field `payload.entrypoint` names a function `biuld` that "
        "agent.py does not define (it defines `build`, `helper`)." in out.stderr
    ), out.stderr
    # Bound otherwise (an import, a class, an assignment), or unknowable: left to the load.
    for name in ("json", "Agent", "build"):
        (tmp_path / name).mkdir()
        other = write_payload(tmp_path / name, GOOD.replace("agent:build", f"agent:{name}"), code)
        assert load_manifest(other).missing_function() is None, name
    (tmp_path / "star").mkdir()
    star = write_payload(
        tmp_path / "star", GOOD.replace("agent:build", "agent:sqrt"), "from math import *\n"
    )
    assert load_manifest(star).missing_function() is None


def test_a_missing_entrypoint_module_names_the_modules_that_exist(tmp_path: Path) -> None:
    """Not "Fix the name.", but what the name could be."""
    folder = write_payload(tmp_path, GOOD.replace("agent:build", "agnet:build"))
    with pytest.raises(ManifestError) as info:
        load_manifest(folder)
    assert info.value.fix == "Did you mean `agent:build`? Modules in this payload: agent."
    (folder / "agent.py").unlink()
    with pytest.raises(ManifestError) as info:
        load_manifest(folder)
    assert "Add the module's .py file to the payload folder" in info.value.fix


def test_shipped_and_test_payloads_define_their_entrypoint() -> None:
    folders = [*PAYLOADS.iterdir(), *TEST_PAYLOADS.iterdir()]
    for folder in folders:
        if (folder / "manifest.toml").is_file():
            assert load_manifest(folder).missing_function() is None, folder


def test_validate_refuses_what_run_refuses_before_a_sandbox(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`validate` makes `run`'s own checks (runner.prepare): a dangerous import and an unset
    declared secret are both reported, exit 2, with what to do; no sandbox is needed for it."""
    monkeypatch.delenv("DEMO_TOKEN", raising=False)
    dangerous = GOOD.replace('["json", "math"]', '["json", "subprocess"]')
    folder = write_payload(tmp_path, dangerous)
    out = cli("validate", str(folder), "--json", env={"DEMO_TOKEN": ""})
    assert out.returncode == 2, out.stderr
    problems = json.loads(out.stdout)["problems"]
    assert len(problems) == 2, problems
    assert "subprocess" in problems[0] and "--i-understand-dangerous-imports" in problems[0]
    assert "DEMO_TOKEN" in problems[1] and "Export DEMO_TOKEN=" in problems[1]
    human = cli("validate", str(folder), "--no-load", env={"DEMO_TOKEN": ""})
    assert human.returncode == 2 and "DEMO_TOKEN" in human.stderr, human.stderr
    # With the same opt-in `run` takes, and the secret set, both checks pass.
    accepted = cli(
        "validate",
        str(folder),
        "--no-load",
        "--i-understand-dangerous-imports",
        env={"DEMO_TOKEN": "set"},
    )
    assert accepted.returncode == 0, accepted.stderr
