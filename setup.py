"""Build hook: the wheel carries the image definitions and the example payloads.

`images/` and `agent_payloads/` stay at the top of the repository (the design fixes the top
level); a wheel has no top level, so the build copies them into the package as
`orchestrator/share/`, where `orchestrator.paths.data_root()` finds them once installed.
Everything else is declared in pyproject.toml.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SHARED = ("images", "agent_payloads")


class BuildWithData(build_py):
    def run(self) -> None:
        super().run()
        share = Path(self.build_lib) / "orchestrator" / "share"
        for name in SHARED:
            target = share / name
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(
                Path(__file__).parent / name,
                target,
                ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".*"),
            )


setup(cmdclass={"build_py": BuildWithData})
