"""A local E2B for tests: the real `e2b` SDK talks to it, sandboxes are Docker containers.

    from tests.e2b_server import E2BTestServer

    with E2BTestServer(templates={"orchestrator-test": "orchestrator-base:bookworm"}) as server:
        os.environ.update(server.env())     # E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY
        sandbox = e2b.Sandbox.create("orchestrator-test", metadata={"run": "1"})

Standalone: `python -m tests.e2b_server --port 3000`.
"""

from .cloud import (
    DEFAULT_API_KEY,
    DEFAULT_IMAGE,
    ApiError,
    FakeE2BCloud,
    RecordedRequest,
    Sandbox,
    StartedCommand,
)
from .docker_sandbox import LABEL, LABEL_SANDBOX, list_containers, reap_orphans
from .server import E2BTestServer
from .templates import IMAGE_REPOSITORY, TemplateBuild

__all__ = [
    "DEFAULT_API_KEY",
    "DEFAULT_IMAGE",
    "IMAGE_REPOSITORY",
    "LABEL",
    "LABEL_SANDBOX",
    "ApiError",
    "E2BTestServer",
    "FakeE2BCloud",
    "RecordedRequest",
    "Sandbox",
    "StartedCommand",
    "TemplateBuild",
    "list_containers",
    "reap_orphans",
]
