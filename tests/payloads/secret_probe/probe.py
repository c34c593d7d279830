"""The bound-secret tests' probe: what a program in the sandbox can find of its secret, and
requests that carry the secret's placeholder (what the sandbox holds) where they are told.

It returns JSON: `env` (ANALYTICS_TOKEN as the environment has it), `environ` (every
ANALYTICS_TOKEN=... in any /proc/*/environ it may read), `tmp` (the text of every file
under /tmp), `ca` (the CA bundle the runtime made it trust) and `outcomes`, one per attempt:

- `{"url", "header": NAME}` (default): GET with requests, the placeholder in header NAME;
- `{"url", "basic": true}`: GET with the placeholder as a Basic password;
- `{"url", "query": true}` / `{"url", "body": true}`: the placeholder in the query / a POST
  body;
- `{"url", "header": NAME, "encode": "base64" | "percent"}`: the placeholder so encoded;
- `{"url", "header": NAME, "host": HOST}`: with the Host header HOST (not the URL's);
- `{"url", "plain": true}`: GET without the placeholder;
- `"client": "requests" | "httpx" | "httpx2" | "urllib"` (any of the above; urllib: headers
  only): the client that makes it (requests by default), each with its own proxy and CA
  settings; httpx2 offers HTTP/2 (it needs `h2` in the payload's requirements);
- `{"url", "header": NAME, "pin": PEM}`: urllib with an SSL context that trusts only the
  CA `PEM` (the server's own, as a client that pins certificates);
- `{"sleep": SECONDS}`: wait (the tests that kill the interceptor mid-run).

Each outcome: `status`, `body` (the response's text, cut) and `version` (the HTTP version,
httpx's), or `error`.

The JSON comes back reversed: the record masks what the sandbox holds (the runtime masks
the placeholder) and the value (the host masks it), in every encoding the maskers know; the
tests read what the sandbox really saw, and look for the value in it.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import httpx
import requests
from smolagents import CodeAgent, tool

NAME = "ANALYTICS_TOKEN"
KEY_MARK = "PRIVATE " + "KEY-----"  # a PEM key's, spelt so that this file holds none


def _environ() -> list[str]:
    found = set()
    for path in Path("/proc").glob("[0-9]*/environ"):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        for item in data.split(b"\0"):
            if item.startswith(f"{NAME}=".encode()):
                found.add(item.decode("latin-1"))
    return sorted(found)


def _tmp() -> dict[str, str]:
    """Each file's text; a large one (the CA bundle: certifi's) by its certificates' count
    and whether it holds a key."""
    found = {}
    for path in Path("/tmp").rglob("*"):
        try:
            if not path.is_file():
                continue
            text = path.read_bytes().decode("latin-1")
        except OSError:
            continue
        if len(text) > 20_000:
            keys = KEY_MARK in text
            text = f"<{text.count('BEGIN CERTIFICATE')} certificates, key: {keys}>"
        found[str(path)] = text
    return found


def _attempt(attempt: dict[str, Any]) -> dict[str, Any]:
    if "sleep" in attempt:
        time.sleep(float(attempt["sleep"]))
        return {"slept": attempt["sleep"]}
    placeholder = os.environ[NAME]
    options: dict[str, Any] = {"timeout": 20}
    method = "GET"
    if attempt.get("plain"):
        pass
    elif attempt.get("basic"):
        options["auth"] = ("user", placeholder)
    elif attempt.get("query"):
        options["params"] = {"token": placeholder}
    elif attempt.get("body"):
        method, options["data"] = "POST", {"token": placeholder}
    else:
        value = _encoded(placeholder, attempt.get("encode"))
        options["headers"] = {attempt.get("header", "X-Api-Key"): value}
        if attempt.get("host"):
            options["headers"]["Host"] = attempt["host"]
    client = "urllib" if attempt.get("pin") else attempt.get("client", "requests")
    try:
        return _SEND[client](method, attempt, options)
    except (requests.RequestException, httpx.HTTPError, OSError) as exc:
        return {"status": None, "error": f"{type(exc).__name__}: {exc}"[:500]}


def _requests(method: str, attempt: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    response = requests.request(method, attempt["url"], **options)
    return {"status": response.status_code, "body": response.text[:4000]}


def _httpx(method: str, attempt: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    """httpx as it comes (its proxy from the environment, its CAs from SSL_CERT_FILE)."""
    return _httpx_outcome(httpx.request(method, attempt["url"], **options))


def _httpx2(method: str, attempt: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    """httpx offering HTTP/2 (needs `h2`, which the agent image lacks: a payload image adds it)."""
    with httpx.Client(http2=True) as client:
        return _httpx_outcome(client.request(method, attempt["url"], **options))


def _httpx_outcome(response: httpx.Response) -> dict[str, Any]:
    return {
        "status": response.status_code,
        "body": response.text[:4000],
        "version": response.http_version,
    }


def _urllib(method: str, attempt: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    """urllib (its proxy from the environment); with `pin`, trusting only that CA."""
    context = ssl.create_default_context(cadata=attempt["pin"]) if attempt.get("pin") else None
    request = urllib.request.Request(
        attempt["url"], method=method, headers=options.get("headers") or {}
    )
    try:
        with urllib.request.urlopen(request, timeout=20, context=context) as response:
            return {"status": response.status, "body": response.read(4000).decode("latin-1")}
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, "body": exc.read(4000).decode("latin-1")}


_SEND = {"requests": _requests, "httpx": _httpx, "httpx2": _httpx2, "urllib": _urllib}


def _encoded(text: str, how: str | None) -> str:
    if how == "base64":
        return base64.b64encode(text.encode()).decode()
    if how == "percent":
        return "".join(f"%{b:02X}" for b in text.encode())
    return text


@tool
def probe(attempts: str) -> str:
    """Look for the secret in the sandbox, then make the attempts.

    Args:
        attempts: a JSON list of attempts (see the module docstring).
    """
    bundle = os.environ.get("REQUESTS_CA_BUNDLE")
    found = {
        "env": os.environ.get(NAME),
        "environ": _environ(),
        "tmp": _tmp(),
        "ca": Path(bundle).read_text()[:4000] if bundle else None,
        "outcomes": [_attempt(a) for a in json.loads(attempts)],
    }
    return json.dumps(found)[::-1]  # reversed: see the module docstring


def build(model):
    return CodeAgent(tools=[probe], model=model, max_steps=2)
