"""What the host and the in-sandbox runtime share: defined here once, imported by both.

Standard library only. The host (`orchestrator`) may import this module; the runtime never
imports the host. docs/PROTOCOL.md describes the protocol these constants belong to.
"""

from __future__ import annotations

#: The request's `protocol` field; the runtime refuses any other.
PROTOCOL_VERSION = 1

#: Model providers the runtime can build (`provider:model_id` on the host's command line).
PROVIDERS = ("mock", "openai", "hf", "litellm")

#: Where the runtime also writes its `run_end` event, for a host whose live stream broke.
RESULT_PATH = "/tmp/orchestrator-result.json"

#: Modules that void the inner executor's guard if agent code may import them. The host
#: refuses them before a run starts (unless the user accepts the risk by name); the runtime
#: checks again. Private modules (`_io`, `_posixsubprocess`, ...) give the same powers, so any
#: `_name` is refused too.
DANGEROUS_IMPORTS = frozenset(
    {
        "*", "os", "posix", "nt", "subprocess", "socket", "sys", "shutil", "importlib",
        "ctypes", "pickle", "marshal", "builtins", "io", "pathlib", "multiprocessing", "pty",
        "signal", "threading", "_thread", "code", "codeop", "inspect", "gc", "resource",
        "fcntl", "mmap", "tempfile", "glob", "asyncio", "concurrent", "runpy", "sysconfig",
        "urllib", "http", "requests", "httpx", "ftplib", "smtplib", "telnetlib", "webbrowser",
    }
)  # fmt: skip


def is_dangerous_import(module: str) -> bool:
    """True for `os`, `os.path`, `os.*`, `*`, `_io`... (a module or any submodule of one)."""
    root = module.split(".")[0]
    return module == "*" or root in DANGEROUS_IMPORTS or root.startswith("_")
