"""The run request (stdin, or a file named by `--request`): parsed and checked before it runs.

Standard library only, so that a bad request is refused without paying for `import smolagents`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
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



class RequestError(ValueError):
    """The request is malformed or not allowed (exit code 2)."""


@dataclass
class Request:
    run_id: str
    task: str
    payload_name: str
    entrypoint: str
    files: dict[str, str]
    authorized_imports: list[str]
    max_steps: int
    provider: str
    model_id: str
    api_base: str | None = None
    credential_env: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    additional_args: dict[str, Any] | None = None
    allow_dangerous_imports: bool = False
    mock_scripts: dict[str, list[str]] = field(default_factory=dict)
    #: Build the agent tree and check it, but run no step (`orchestrator validate`).
    check_only: bool = False
    secrets: dict[str, str] = field(default_factory=dict)
    result_path: str | None = None
    #: Process limits the runtime sets on itself (E2B, where the sandbox has no per-run
    #: limits of its own): `nproc`, `nofile`, `core` -> value.
    rlimits: dict[str, int] = field(default_factory=dict)


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
    """The secrets, checked first so that every later message can already be masked.

    They come in the request (`secrets`: name -> value, the Docker backend's stdin) or by
    name only (`secret_env`: the E2B backend passes the values as the command's environment,
    so they are never written to a file in the sandbox).
    """
    secrets = dict(_get(data, "secrets", dict, {}))
    for name in _get(data, "secret_env", list, []):
        if not isinstance(name, str) or name not in os.environ:
            raise RequestError(f"secret `{name}` named in secret_env is not in the environment")
        secrets[name] = os.environ[name]
    for name, value in secrets.items():
        if not ENV_NAME_RE.match(name) or not isinstance(value, str):
            raise RequestError(f"secret `{name}` needs an environment-variable name and a string")
    return secrets


def parse_request(data: dict[str, Any]) -> Request:
    """Check every field of the request; raise RequestError naming the first bad one."""
    if data.get("protocol") != PROTOCOL_VERSION:
        raise RequestError(
            f"unsupported protocol {data.get('protocol')!r}: this runtime speaks {PROTOCOL_VERSION}"
        )
    payload = _get(data, "payload", dict)
    model = _get(data, "model", dict)
    request = Request(
        run_id=_get(data, "run_id", str),
        task=_get(data, "task", str),
        payload_name=_get(payload, "name", str),
        entrypoint=_get(payload, "entrypoint", str),
        files=_get(payload, "files", dict),
        authorized_imports=_get(data, "authorized_imports", list, []),
        max_steps=_get(data, "max_steps", int, 10),
        provider=_get(model, "provider", str),
        model_id=_get(model, "model_id", str, "scripted"),
        api_base=_get(model, "api_base", str, None),
        credential_env=_get(model, "credential_env", str, None),
        options=_get(model, "options", dict, {}),
        additional_args=_get(data, "additional_args", dict, None),
        allow_dangerous_imports=_get(data, "allow_dangerous_imports", bool, False),
        mock_scripts=_get(data, "mock_scripts", dict, {}),
        check_only=_get(data, "check_only", bool, False),
        secrets=secrets_of(data),
        result_path=_get(data, "result_path", str, None),
        rlimits=_get(data, "rlimits", dict, {}),
    )
    for name, value in request.rlimits.items():
        if name not in RLIMITS or not isinstance(value, int) or isinstance(value, bool):
            raise RequestError(f"rlimit {name!r} must be one of {RLIMITS} with a whole number")
        if value < 0:
            raise RequestError(f"rlimit {name!r} must not be negative")
    if not request.task.strip():
        raise RequestError("the task is empty")
    if not ENTRYPOINT_RE.match(request.entrypoint):
        raise RequestError(f"entrypoint {request.entrypoint!r} is not `module:function`")
    for path, content in request.files.items():
        binary = isinstance(content, dict) and isinstance(content.get("base64"), str)
        if not isinstance(content, str) and not binary:
            raise RequestError(f"payload file {path!r} must be text or {{'base64': ...}}")
    if not 1 <= request.max_steps <= 1000:
        raise RequestError(f"max_steps must be from 1 to 1000, not {request.max_steps}")
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
    if request.credential_env and request.credential_env not in request.secrets:
        raise RequestError(f"credential_env {request.credential_env!r} is not among the secrets")
    return request
