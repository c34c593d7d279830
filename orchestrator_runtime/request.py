"""The run request, defined once for both sides (docs/PROTOCOL.md, "The request").

The host builds a `Request` (`orchestrator.lifecycle.runner.build_request`), each backend
adds its part with `dataclasses.replace` (Docker: `secrets`; E2B: `secret_env`, `rlimits`) and ships
`to_json()` once (stdin, or an uploaded file); the runtime reads that JSON back with
`parse_request`, which checks every field. Each field names its place in the JSON object
(`_field`), so the encoding and the decoding follow from this one definition.

Standard library only, so that a bad request is refused without paying for `import smolagents`
and so that the host may import it (the runtime never imports the host).
"""

from __future__ import annotations

import json
import os
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from .protocol import (
    ENTRYPOINT_RE,
    ENV_NAME_RE,
    MODULE_RE,
    PROTOCOL_VERSION,
    PROVIDERS,
    is_dangerous_import,
)

#: Limits a request may ask the runtime to set on itself.
RLIMITS = ("nproc", "nofile", "core")
#: Who set a request's `max_steps` (see `Request.max_steps_from`).
MAX_STEPS_FROM = ("program", "manifest", "run")

#: Whose models a run's agents use (see `Request.model_source`).
MODEL_SOURCES = ("run", "program")

#: The sub-objects of the request (`payload.name`, `model.provider`, ...).
SECTIONS = ("payload", "model")


class RequestError(ValueError):
    """The request is malformed or not allowed (exit code 2)."""


def _field(key: str, kind: type, *, section: str | None = None, **options: Any) -> Any:
    """A dataclass field and its place on the wire: its `key` (in `section`), the JSON type
    it must have there, and `omit_empty` (an empty value is not sent: the backend that does
    not use the field leaves it out; Docker sends no `secret_env`, E2B no `secrets`).
    `default`/`default_factory` as for `dataclasses.field`; without one the field is required."""
    omit_empty = options.pop("omit_empty", False)
    metadata = {"key": key, "kind": kind, "section": section, "omit_empty": omit_empty}
    return field(metadata=metadata, **options)


@dataclass(kw_only=True)
class Request:
    """One run, as the runtime is asked to do it. Field order is the JSON object's order.

    Not frozen (that costs half a millisecond of import on both sides' cold start), but
    treated as a value: a backend adds its part with `dataclasses.replace`."""

    run_id: str = _field("run_id", str)
    task: str = _field("task", str)
    #: Keyword arguments of the manager's `run` (null: none).
    additional_args: dict[str, Any] | None = _field("additional_args", dict, default=None)
    payload_name: str = _field("name", str, section="payload")
    #: `module:function` that builds the manager from the model ("" for a program).
    entrypoint: str = _field("entrypoint", str, section="payload", default="")
    #: A program (a script run as `__main__`, its path among `files`) instead of an
    #: entrypoint; None for a payload.
    program: str | None = _field("program", str, section="payload", default=None)
    #: The program's arguments (`sys.argv[1:]`).
    argv: list[str] = _field("argv", list, section="payload", default_factory=list)
    #: The program's `requires-python` (PEP 723), checked against this interpreter.
    requires_python: str | None = _field("requires_python", str, section="payload", default=None)
    #: Path -> text, or `{"base64": ...}` for a file that is not UTF-8.
    files: dict[str, str | dict[str, str]] = _field("files", dict, section="payload")
    authorized_imports: list[str] = _field("authorized_imports", list, default_factory=list)
    allow_dangerous_imports: bool = _field("allow_dangerous_imports", bool, default=False)
    max_steps: int = _field("max_steps", int, default=10)
    #: Who set `max_steps`: "manifest" or "run" (the run's options) cap every agent at it;
    #: "program" (neither did) lets each agent keep its own, up to the protocol's maximum.
    max_steps_from: str = _field("max_steps_from", str, default="manifest")
    #: The run's network policy (`none`, `allowlist`, `open`; "" unknown): which attempts the
    #: runtime's egress audit reports.
    network: str = _field("network", str, default="")
    provider: str = _field("provider", str, section="model")
    model_id: str = _field("model_id", str, section="model", default="scripted")
    api_base: str | None = _field("api_base", str, section="model", default=None)
    credential_env: str | None = _field("credential_env", str, section="model", default=None)
    options: dict[str, Any] = _field("options", dict, section="model", default_factory=dict)
    #: Variables a program reads its models' endpoint from: each set to `api_base` before
    #: the program runs (a client that reads its endpoint from the environment finds it).
    endpoint_env: list[str] = _field("endpoint_env", list, section="model", default_factory=list)
    #: Variables the model's client reads that are not secret (a Bedrock model's region),
    #: set before any payload code runs.
    model_env: dict[str, str] = _field(
        "env", dict, section="model", default_factory=dict, omit_empty=True
    )
    #: Whose models the agents use: "run" (the model above replaces every model; `mock`
    #: plays scripts per agent) or "program" (a program's own models, each sent to
    #: `api_base` with the `credential_env` value when there is one).
    model_source: str = _field("source", str, section="model", default="run")
    mock_scripts: dict[str, list[str]] = _field("mock_scripts", dict, default_factory=dict)
    result_path: str | None = _field("result_path", str, default=None)
    #: Build the agent tree and check it, but run no step (`orchestrator validate`).
    check_only: bool = _field("check_only", bool, default=False)
    #: Name -> value (the Docker backend, on stdin).
    secrets: dict[str, str] = _field(
        "secrets", dict, default_factory=dict, omit_empty=True, repr=False
    )
    #: Names of secrets whose values are in the runtime's environment (the E2B backend).
    secret_env: list[str] = _field("secret_env", list, default_factory=list, omit_empty=True)
    #: Process limits the runtime sets on itself (E2B, where the sandbox has no per-run
    #: limits of its own): `nproc`, `nofile`, `core` -> value.
    rlimits: dict[str, int] = _field("rlimits", dict, default_factory=dict, omit_empty=True)
    #: The run's CA certificate (PEM), with bound secrets: an intercepting proxy on the
    #: egress path presents certificates of this CA; trusted before the payload (trust.py).
    trust_ca: str = _field("trust_ca", str, default="", omit_empty=True, repr=False)
    #: The host's trace of the run (`trace_id`, `parent_span_id`: its root span): the runtime
    #: then writes the run's OpenTelemetry spans as `span` events. Empty: no spans.
    trace: dict[str, str] = _field("trace", dict, default_factory=dict, omit_empty=True)

    def to_wire(self) -> dict[str, Any]:
        """The JSON object of docs/PROTOCOL.md (with `protocol`), fields in their sections."""
        data: dict[str, Any] = {"protocol": PROTOCOL_VERSION}
        for item in fields(self):
            wire, value = item.metadata, getattr(self, item.name)
            if wire["omit_empty"] and not value:
                continue
            within = data.setdefault(wire["section"], {}) if wire["section"] else data
            within[wire["key"]] = value
        return data

    def to_json(self) -> str:
        """What a backend ships: the request's one serialisation."""
        return json.dumps(self.to_wire())

    def secret_values(self) -> dict[str, str]:
        """Every secret: those of `secrets` and, by name, those of `secret_env` from this
        process's environment (raises RequestError for a name that is not there)."""
        return resolve_secrets(self.secrets, self.secret_env)


def resolve_secrets(secrets: dict[str, str], secret_env: list[str]) -> dict[str, str]:
    """`secrets` and the values of the `secret_env` names in this process's environment,
    each with an environment-variable name and a string value (else RequestError)."""
    values = dict(secrets)
    for name in secret_env:
        if not isinstance(name, str) or name not in os.environ:
            raise RequestError(f"secret `{name}` named in secret_env is not in the environment")
        values[name] = os.environ[name]
    for name, value in values.items():
        if not ENV_NAME_RE.match(name) or not isinstance(value, str):
            raise RequestError(f"secret `{name}` needs an environment-variable name and a string")
    return values


def wire_fields() -> dict[str, str]:
    """Field name -> its place on the wire (`task`, `payload.name`, `model.provider`, ...)."""
    return {
        item.name: ".".join(filter(None, (item.metadata["section"], item.metadata["key"])))
        for item in fields(Request)
    }


def load_json(raw: bytes) -> dict[str, Any]:
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequestError(f"stdin is not one UTF-8 JSON object: {exc}") from None
    if not isinstance(data, dict):
        raise RequestError("stdin must hold one JSON object")
    return data


def _get(data: dict[str, Any], key: str, kind: type, default: Any = ...) -> Any:
    """`data[key]` checked against `kind` (bools are not ints); `default` when absent or null."""
    value = data.get(key)
    if value is None:
        if default is ...:
            raise RequestError(f"request field `{key}` is missing")
        return default
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise RequestError(f"request field `{key}` has the wrong type ({type(value).__name__})")
    return value


def secrets_of(data: dict[str, Any]) -> dict[str, str]:
    """The secrets of a request not parsed yet, checked first so that every later message can
    already be masked.

    They come in the request (`secrets`: name -> value, the Docker backend's stdin) or by
    name only (`secret_env`: the E2B backend passes the values as the command's environment,
    so they are never written to a file in the sandbox). Raises RequestError.
    """
    return resolve_secrets(_get(data, "secrets", dict, {}), _get(data, "secret_env", list, []))


def _check_known(data: dict[str, Any]) -> None:
    """No field the runtime does not know: a newer host's field (a limit, say) is refused
    rather than silently dropped."""
    known: dict[str | None, set[str]] = {None: {"protocol", *SECTIONS}}
    for item in fields(Request):
        known.setdefault(item.metadata["section"], set()).add(item.metadata["key"])
    for section in (None, *SECTIONS):
        within = data if section is None else data.get(section)
        if not isinstance(within, dict):
            continue
        for key in sorted(set(within) - known[section]):
            where = f"{section}.{key}" if section else key
            raise RequestError(
                f"unknown request field `{where}`: this runtime speaks protocol "
                f"{PROTOCOL_VERSION} (docs/PROTOCOL.md)"
            )


def parse_request(data: dict[str, Any]) -> Request:
    """The request of a JSON object, every field checked; raises RequestError naming the first
    bad one. `Request.to_wire` of the result gives the object back (less empty optional
    fields)."""
    if data.get("protocol") != PROTOCOL_VERSION:
        raise RequestError(
            f"unsupported protocol {data.get('protocol')!r}: this runtime speaks {PROTOCOL_VERSION}"
        )
    secrets_of(data)
    _check_known(data)
    values: dict[str, Any] = {}
    for item in fields(Request):
        wire = item.metadata
        within = _get(data, wire["section"], dict) if wire["section"] else data
        if item.default is not MISSING:
            default = item.default
        elif item.default_factory is not MISSING:
            default = item.default_factory()
        else:
            default = ...
        values[item.name] = _get(within, wire["key"], wire["kind"], default)
    request = Request(**values)
    _check(request)
    return request


def _check(request: Request) -> None:
    """The rules a well-typed request must also follow (RequestError for the first broken)."""
    for name, value in request.rlimits.items():
        if name not in RLIMITS or not isinstance(value, int) or isinstance(value, bool):
            raise RequestError(f"rlimit {name!r} must be one of {RLIMITS} with a whole number")
        if value < 0:
            raise RequestError(f"rlimit {name!r} must not be negative")
    if request.trace and (
        sorted(request.trace) != ["parent_span_id", "trace_id"]
        or not _is_hex(request.trace["trace_id"], 32)
        or not _is_hex(request.trace["parent_span_id"], 16)
    ):
        raise RequestError("trace must be {trace_id: 32 hex digits, parent_span_id: 16 hex digits}")
    if request.trust_ca and (problem := _ca_problem(request.trust_ca)):
        raise RequestError(problem)
    if request.program is None:
        if not request.task.strip():
            raise RequestError("the task is empty")
        if not ENTRYPOINT_RE.match(request.entrypoint):
            raise RequestError(f"entrypoint {request.entrypoint!r} is not `module:function`")
    elif request.entrypoint or request.program not in request.files:
        raise RequestError("a program is one of the payload's files, and has no entrypoint")
    if not all(isinstance(arg, str) for arg in request.argv):
        raise RequestError("argv must be a list of strings")
    if request.model_source not in MODEL_SOURCES:
        raise RequestError(f"model.source must be one of {MODEL_SOURCES}")
    for path, content in request.files.items():
        binary = isinstance(content, dict) and isinstance(content.get("base64"), str)
        if not isinstance(content, str) and not binary:
            raise RequestError(f"payload file {path!r} must be text or {{'base64': ...}}")
    if not 1 <= request.max_steps <= 1000:
        raise RequestError(f"max_steps must be from 1 to 1000, not {request.max_steps}")
    if request.max_steps_from not in MAX_STEPS_FROM:
        raise RequestError(f"max_steps_from must be one of {MAX_STEPS_FROM}")
    if request.provider not in PROVIDERS:
        raise RequestError(f"unknown model provider {request.provider!r}; use one of {PROVIDERS}")
    for name, script in request.mock_scripts.items():
        if not isinstance(script, list) or not all(isinstance(s, str) for s in script):
            raise RequestError(f"mock script of agent {name!r} must be a list of strings")
    for module in request.authorized_imports:
        if not isinstance(module, str) or not MODULE_RE.match(module):
            raise RequestError(f"authorized import {module!r} is not a module name")
    dangerous = sorted(m for m in request.authorized_imports if is_dangerous_import(m))
    if dangerous and not request.allow_dangerous_imports:
        raise RequestError(
            f"dangerous modules in authorized_imports: {', '.join(dangerous)}. They would let "
            "agent code escape the executor's guard; set allow_dangerous_imports to allow them."
        )
    for name in request.endpoint_env:
        if not isinstance(name, str) or not ENV_NAME_RE.match(name):
            raise RequestError(f"endpoint_env {name!r} is not a variable name")
    if request.endpoint_env and not request.api_base:
        raise RequestError("endpoint_env names variables for an api_base, and there is none")
    for variable, setting in request.model_env.items():
        if not ENV_NAME_RE.match(variable) or not isinstance(setting, str):
            raise RequestError(f"model env {variable!r} is not a variable with a string value")
    secret_names = {*request.secrets, *request.secret_env}
    if request.credential_env and request.credential_env not in secret_names:
        raise RequestError(f"credential_env {request.credential_env!r} is not among the secrets")


def _ca_problem(pem: str) -> str | None:
    """What is wrong with `pem` as the run's CA (its shape: PEM certificates, nothing
    secret), or None; whether OpenSSL loads it is `trust.trust_ca`'s (ssl is not imported
    on the way to a request's first check)."""
    text = pem.strip()
    begin, end = "-----BEGIN CERTIFICATE-----", "-----END CERTIFICATE-----"
    if not text.startswith(begin) or not text.endswith(end):
        return "trust_ca must be PEM certificates"
    if "PRIVATE KEY" in text:
        return "trust_ca must hold certificates only, never a key"
    return None


def _is_hex(value: Any, length: int) -> bool:
    """A lower-case hex id of `length` digits that is not all zeros (OpenTelemetry's ids)."""
    return (
        isinstance(value, str)
        and len(value) == length
        and all(c in "0123456789abcdef" for c in value)
        and value.strip("0") != ""
    )
