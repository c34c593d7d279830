"""AWS Signature Version 4 at the gateway: the sandbox's signature checked, the host's put on.

A Bedrock client in the sandbox signs each request with the run's own AWS credentials (random,
made by the host for this run and worthless anywhere else). The gateway computes that
signature again with botocore's own SigV4 code from the request as it arrived (method, the
path as sent, query, the headers the client says it signed, the body, its X-Amz-Date),
compares it in constant time, and refuses a request whose key id, scope, date, body hash or
signature is not the run's. It then signs the request again with the host's credentials for
the real endpoint (botocore's `SigV4Auth`) before it is forwarded.

botocore is in the agent image; this module is imported only by a gateway that signs.
"""

from __future__ import annotations

import datetime
import hmac
import json
from dataclasses import dataclass
from typing import Any

from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

#: How far a request's X-Amz-Date may be from the gateway's clock (AWS's own limit).
MAX_SKEW_SECONDS = 15 * 60
#: SigV4's timestamp format (X-Amz-Date).
AMZ_DATE = "%Y%m%dT%H%M%SZ"
#: Headers of the sandbox's signature, never forwarded: the gateway signs anew.
SIGNATURE_HEADERS = frozenset(
    {b"authorization", b"x-amz-date", b"x-amz-security-token", b"x-amz-content-sha256"}
)


@dataclass(frozen=True)
class AwsKeys:
    """One set of AWS credentials."""

    access_key_id: str
    secret_access_key: str
    session_token: str | None = None

    @classmethod
    def from_json(cls, data: Any, what: str) -> AwsKeys:
        """Raises ValueError naming `what` for a wrong shape."""
        if not isinstance(data, dict):
            raise ValueError(f"{what} must be an object")
        key_id, secret = data.get("access_key_id"), data.get("secret_access_key")
        token = data.get("session_token")
        if not (isinstance(key_id, str) and key_id and isinstance(secret, str) and secret):
            raise ValueError(f"{what} needs `access_key_id` and `secret_access_key`")
        if token is not None and not isinstance(token, str):
            raise ValueError(f"{what}'s `session_token` must be a string")
        return cls(key_id, secret, token or None)

    def credentials(self) -> Credentials:
        return Credentials(self.access_key_id, self.secret_access_key, self.session_token)


@dataclass(frozen=True)
class Signing:
    """A signing gateway's configuration: the scope (region, service), the run's credentials
    (what the sandbox signs with) and the host's (what the gateway signs with)."""

    region: str
    service: str
    run: AwsKeys
    host: AwsKeys

    @classmethod
    def from_json(cls, data: Any, key: str | None) -> Signing:
        """From the configuration's `signing` object and its `key` (the host's credentials
        as a JSON object). Raises ValueError naming the first bad field."""
        if not isinstance(data, dict) or data.get("kind") != "aws-sigv4":
            raise ValueError("`signing` must be an object of kind aws-sigv4")
        region, service = data.get("region"), data.get("service")
        if not (isinstance(region, str) and region and isinstance(service, str) and service):
            raise ValueError("`signing` needs `region` and `service`")
        try:
            host = json.loads(key or "")
        except ValueError:
            raise ValueError("`key` must hold the host's AWS credentials as JSON") from None
        return cls(
            region=region,
            service=service,
            run=AwsKeys.from_json(data, "`signing`"),
            host=AwsKeys.from_json(host, "`key`"),
        )

    def check(
        self,
        method: str,
        raw_path: str,
        query: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        now: float,
    ) -> str | None:
        """Why the request is not signed with the run's credentials, or None when it is."""
        given = _header_map(headers)
        parts = _authorization(given.get("authorization", ""))
        if parts is None:
            return "no AWS Signature Version 4 in the Authorization header"
        scope = parts["Credential"].split("/")
        if len(scope) != 5 or scope[4] != "aws4_request":
            return "the signature's credential scope is malformed"
        key_id, day, region, service, _ = scope
        if not hmac.compare_digest(key_id.encode(), self.run.access_key_id.encode()):
            return "signed with an access key that is not this run's"
        if (region, service) != (self.region, self.service):
            return f"signed for {service} in {region}, not {self.service} in {self.region}"
        amz_date = given.get("x-amz-date", "")
        try:
            signed_at = datetime.datetime.strptime(amz_date, AMZ_DATE)
        except ValueError:
            return "no valid X-Amz-Date"
        stamp = signed_at.replace(tzinfo=datetime.timezone.utc).timestamp()
        if abs(now - stamp) > MAX_SKEW_SECONDS or day != amz_date[:8]:
            return "the signature's date is not now"
        signed = parts["SignedHeaders"].split(";")
        if "host" not in signed or "x-amz-date" not in signed:
            return "the signature does not cover the Host and X-Amz-Date headers"
        request = AWSRequest(
            method=method,
            url=f"http://{given.get('host', '')}{raw_path}" + (f"?{query}" if query else ""),
            data=body,
        )
        for name, value in headers:  # exactly the headers the client says it signed
            text = name.decode("latin-1").lower()
            if text in signed:
                request.headers[text] = value.decode("latin-1")
        request.context["timestamp"] = amz_date
        auth = SigV4Auth(self.run.credentials(), self.service, self.region)
        claimed = given.get("x-amz-content-sha256")
        if claimed is not None and not hmac.compare_digest(
            claimed.encode(), auth.payload(request).encode()
        ):
            return "the body does not match its X-Amz-Content-SHA256"
        expected = auth.signature(
            auth.string_to_sign(request, auth.canonical_request(request)), request
        )
        if not hmac.compare_digest(expected.encode(), parts["Signature"].encode()):
            return "the signature does not match the request"
        return None

    def sign(
        self, method: str, url: str, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> list[tuple[bytes, bytes]]:
        """`headers` less the sandbox's signature, signed with the host's credentials for
        `url` (the real endpoint): X-Amz-Date, the session token if any, Authorization."""
        request = AWSRequest(method=method, url=url, data=body)
        for name, value in headers:
            if name.lower() not in SIGNATURE_HEADERS:
                request.headers[name.decode("latin-1")] = value.decode("latin-1")
        SigV4Auth(self.host.credentials(), self.service, self.region).add_auth(request)
        return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in request.headers.items()]


def _header_map(headers: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """The request's headers by lower-case name (the last of a repeated one)."""
    return {k.decode("latin-1").lower(): v.decode("latin-1").strip() for k, v in headers}


def _authorization(value: str) -> dict[str, str] | None:
    """`AWS4-HMAC-SHA256 Credential=..., SignedHeaders=..., Signature=...` as its three
    parts, or None for anything else."""
    algorithm, _, rest = value.partition(" ")
    if algorithm != "AWS4-HMAC-SHA256":
        return None
    parts = {}
    for item in rest.split(","):
        name, sep, part = item.strip().partition("=")
        if not sep or not part:
            return None
        parts[name] = part
    if set(parts) != {"Credential", "SignedHeaders", "Signature"}:
        return None
    return parts
