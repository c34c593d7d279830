"""Amazon Bedrock as the host reaches it: region, endpoint and credentials from botocore.

Amazon Bedrock's client (boto3) is asked of botocore, the AWS SDK's core: its endpoint
rules (the user's AWS_ENDPOINT_URL_BEDROCK_RUNTIME or AWS_ENDPOINT_URL, the region's
partition), its region settings and its credential chain. The host's AWS credentials never
enter a sandbox: its Bedrock client signs with credentials of the run's own (`RunSigning`:
random, made for one run, worthless anywhere else) and sends its calls to the run's gateway,
which checks that signature and signs each call again with the host's credentials
(`orchestrator_runtime/gateway/sigv4.py`). botocore is imported only for a Bedrock run (the
`bedrock` extra).
"""

from __future__ import annotations

import json
import os
import secrets as random_tokens
import string
from dataclasses import dataclass, field
from typing import Any

from orchestrator_runtime.protocol import AWS_REGION_ENV, BEDROCK_ENDPOINT_ENV

from ..errors import ConfigError

#: The variables an AWS client reads its credentials from: the host's, on the host; the
#: run's own, in the sandbox (never a session token there).
ACCESS_KEY_ENV = "AWS_ACCESS_KEY_ID"
SECRET_KEY_ENV = "AWS_SECRET_ACCESS_KEY"
SESSION_TOKEN_ENV = "AWS_SESSION_TOKEN"
CREDENTIAL_ENV = (ACCESS_KEY_ENV, SECRET_KEY_ENV, SESSION_TOKEN_ENV)
#: The variable botocore reads Bedrock Runtime's endpoint from (the user's, on the host; the
#: run's gateway, in the sandbox), and the region variables (AWS_REGION, then botocore's own
#: AWS_DEFAULT_REGION and profile, on the host; both, in the sandbox).
ENDPOINT_ENV = BEDROCK_ENDPOINT_ENV
REGION_ENV = AWS_REGION_ENV
#: Set in a Bedrock model's sandbox: no instance role there, so botocore's credential chain
#: must not wait on the metadata endpoint for one.
AWS_NO_INSTANCE_ROLE = {"AWS_EC2_METADATA_DISABLED": "true"}
#: Bedrock Runtime's name for signatures (the SigV4 scope's service).
SERVICE = "bedrock"
#: The client botocore makes for it.
CLIENT = "bedrock-runtime"
#: How the run's access key id begins (the rest random): recognisable as not AWS's.
RUN_KEY_PREFIX = "ORCHRUN"


@dataclass(frozen=True)
class RunSigning:
    """A Bedrock run's signing: the region and service its calls are signed for, and the
    run's own credentials, made for this run (what the sandbox signs with)."""

    region: str
    access_key_id: str
    secret_access_key: str = field(repr=False)
    service: str = SERVICE

    @classmethod
    def new(cls, region: str) -> RunSigning:
        """Random credentials shaped like AWS's (a 20-character key id, a 40-character secret)."""
        alphabet = string.ascii_uppercase + string.digits
        suffix = "".join(random_tokens.choice(alphabet) for _ in range(20 - len(RUN_KEY_PREFIX)))
        return cls(region, RUN_KEY_PREFIX + suffix, random_tokens.token_urlsafe(30))

    def gateway_config(self) -> dict[str, str]:
        """The gateway's `signing` object: what it checks each call's signature against."""
        return {
            "kind": "aws-sigv4",
            "region": self.region,
            "service": self.service,
            "access_key_id": self.access_key_id,
            "secret_access_key": self.secret_access_key,
        }

    def sandbox_env(self) -> dict[str, str]:
        """The sandbox's AWS credentials: the run's own."""
        return {ACCESS_KEY_ENV: self.access_key_id, SECRET_KEY_ENV: self.secret_access_key}


def host_region() -> str | None:
    """The region AWS's tools on this host use: AWS_REGION, else botocore's (AWS_DEFAULT_REGION,
    the profile's `region`); None when none is set."""
    region = os.environ.get(REGION_ENV[0])
    if region:
        return region
    value = _session().get_config_variable("region")
    return value if isinstance(value, str) and value else None


def bedrock_endpoint(region: str) -> str:
    """Bedrock Runtime's endpoint for `region` as botocore resolves it on this host: the
    user's AWS_ENDPOINT_URL_BEDROCK_RUNTIME or AWS_ENDPOINT_URL (or the profile's
    `endpoint_url`), else the region's own (`https://bedrock-runtime.REGION.amazonaws.com`,
    another domain in AWS's other partitions). Raises ConfigError for a region botocore
    cannot place."""
    try:
        client = _session().create_client(
            CLIENT,
            region_name=region,
            aws_access_key_id="unused",  # no credential lookup: only the endpoint is wanted
            aws_secret_access_key="unused",
        )
    except Exception as exc:  # botocore's InvalidRegionError and kin
        raise ConfigError(
            f"botocore cannot place Bedrock in the region {region!r} ({exc}).",
            "Give the model a valid AWS region (region_name in its client_kwargs, or "
            "AWS_REGION on this host).",
        ) from exc
    return str(client.meta.endpoint_url).rstrip("/")


def host_credentials() -> dict[str, str]:
    """The host's AWS credentials, as botocore's chain finds them (the environment, the
    shared credentials and config files and their profile, SSO, a container or instance
    role), by the variable each goes by; taken once, when the run is prepared. Raises
    ConfigError when there are none."""
    found = _session().get_credentials()
    frozen = found.get_frozen_credentials() if found is not None else None
    if frozen is None or not frozen.access_key or not frozen.secret_key:
        raise ConfigError(
            "The run's Bedrock model needs AWS credentials on this host, and botocore finds "
            "none (environment, shared credentials file, profile, SSO or role). Nothing was "
            "started.",
            f"Export {ACCESS_KEY_ENV} and {SECRET_KEY_ENV} (or set AWS_PROFILE); they stay "
            "with the run's gateway, outside the sandbox.",
        )
    values = {ACCESS_KEY_ENV: frozen.access_key, SECRET_KEY_ENV: frozen.secret_key}
    if frozen.token:
        values[SESSION_TOKEN_ENV] = frozen.token
    return values


def gateway_key(secrets: dict[str, str]) -> str:
    """The key a signing gateway gets on its stdin: the host's credentials (among `secrets`,
    by variable) as one JSON object."""
    return json.dumps(
        {
            "access_key_id": secrets.get(ACCESS_KEY_ENV),
            "secret_access_key": secrets.get(SECRET_KEY_ENV),
            "session_token": secrets.get(SESSION_TOKEN_ENV),
        }
    )


def _session() -> Any:
    """A botocore session reading this host's AWS settings. Raises ConfigError without
    botocore."""
    try:
        import botocore.session
    except ImportError:
        raise ConfigError(
            "A Bedrock model needs botocore on this host (it reads the AWS credentials, "
            "region and endpoint as AWS's own tools do), and it is not installed.",
            "Install it: pip install 'orchestrator[bedrock]'.",
        ) from None
    return botocore.session.get_session()
