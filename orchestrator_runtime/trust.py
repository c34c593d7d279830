"""The run's CA, trusted by the sandbox's Python before the payload is imported.

A run with bound secrets goes out through an intercepting proxy that presents certificates
of a CA made for the run (docs/PROTOCOL.md, `trust_ca`): the runtime writes a bundle of that
CA and the CAs Python trusted until then, and points every usual client at it (`ssl`'s
default context and urllib through `SSL_CERT_FILE`, requests through `REQUESTS_CA_BUNDLE`,
httpx through `SSL_CERT_FILE`, curl, and `certifi.where()`). Only the CA's certificate ever
comes here, never its key. Standard library only (certifi when installed).
"""

from __future__ import annotations

import os
import ssl
import tempfile
from pathlib import Path

#: The environment variables that name a CA bundle for the clients a payload may use.
BUNDLE_ENV = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")


def trusted_until_now() -> str:
    """The CAs this Python trusts by default: certifi's bundle, else OpenSSL's file."""
    try:
        import certifi

        return Path(certifi.where()).read_text()
    except (ImportError, OSError):
        cafile = ssl.get_default_verify_paths().cafile
        try:
            return Path(cafile).read_text() if cafile else ""
        except OSError:
            return ""


def trust_ca(pem: str) -> Path:
    """Make `pem` trusted by this process and its children; the bundle's path. Raises
    ValueError for a certificate OpenSSL will not load."""
    try:
        ssl.create_default_context(cadata=pem)
    except (ssl.SSLError, ValueError) as exc:
        raise ValueError(f"trust_ca is not a certificate OpenSSL loads ({exc})") from None
    bundle = Path(tempfile.mkdtemp(prefix="orchestrator-ca-")) / "ca-bundle.pem"
    bundle.write_text(pem.strip() + "\n" + trusted_until_now())
    bundle.chmod(0o444)
    os.environ.update({name: str(bundle) for name in BUNDLE_ENV})
    try:
        import certifi
        import certifi.core
    except ImportError:
        return bundle
    certifi.where = certifi.core.where = lambda: str(bundle)  # clients that ask certifi
    return bundle
