"""`orchestrator images ...`: build, bootstrap, list and prune sandbox images, each through
the chosen backend's own methods (refused, exit 2, on a backend that cannot)."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from ..registry import DEFAULT_BACKEND, backend_names, backends_help
from .parser import HELP

if TYPE_CHECKING:
    from ..backends.base import ImageStore


def add_backend_option(parser: Any, what: str) -> None:
    parser.add_argument(
        "--backend",
        choices=backend_names(),
        default=DEFAULT_BACKEND,
        help=f"{what}: {backends_help()}",
    )


def add_images_parser(sub: Any) -> None:
    p = sub.add_parser("images", help=HELP["images"])
    isub = p.add_subparsers(title="images commands", metavar="ACTION")
    b = isub.add_parser(
        "build",
        help="build (or reuse) the agent image, and a payload's derived image",
        description="Build the agent image (Docker) or template (E2B) if it does not exist yet; "
        "prints its tag or template name. Content-addressed: unchanged inputs never rebuild.",
    )
    b.add_argument("--payload", help="also build the derived image for this payload's requirements")
    b.add_argument("--json", action="store_true", help="print {image} as JSON")
    b.add_argument(
        "--base",
        help="base image (docker default: $ORCHESTRATOR_BASE_IMAGE or python:3.12-slim; "
        "e2b default: $ORCHESTRATOR_E2B_BASE_IMAGE or python:3.12-slim)",
    )
    add_backend_option(b, "where the image is for")
    b.set_defaults(handler=cmd_images_build)
    bb = isub.add_parser(
        "bootstrap-base",
        help="make a Debian base image with debootstrap + docker import (no registry needed)",
    )
    bb.add_argument(
        "--suite",
        default="bookworm",
        help="Debian release to bootstrap, tagged orchestrator-base:SUITE (bookworm: the "
        "agent's base; trixie: the secret interceptor's)",
    )
    bb.add_argument("--mirror", default="http://deb.debian.org/debian", help="Debian mirror")
    bb.add_argument("--json", action="store_true", help="print {image} as JSON")
    add_backend_option(bb, "whose base image")
    bb.set_defaults(handler=cmd_images_bootstrap)
    ls = isub.add_parser("list", help="list orchestrator images")
    ls.add_argument("--json", action="store_true", help="print the images as a JSON array")
    add_backend_option(ls, "whose images")
    ls.set_defaults(handler=cmd_images_list)
    pr = isub.add_parser("prune", help="remove orchestrator images that are no longer current")
    pr.add_argument("--dry-run", action="store_true", help="say what would go; remove nothing")
    pr.add_argument("--json", action="store_true", help="print the removed tags as JSON")
    add_backend_option(pr, "whose images")
    pr.set_defaults(handler=cmd_images_prune)
    p.set_defaults(handler=lambda a: (p.print_help(), 2)[1])


def backend_that_can(name: str, what: str) -> ImageStore:
    """The backend `name`, made, if it keeps its images itself (`ImageStore`, checked on its
    class before it is made); else ConfigError (exit 2) naming the backends that do."""
    from ..backends import backend_class, get_backend
    from ..backends.base import ImageStore
    from ..errors import ConfigError

    if not issubclass(backend_class(name), ImageStore):
        able = []
        for other in backend_names():
            try:
                if issubclass(backend_class(other), ImageStore):
                    able.append(other)
            except ConfigError:
                continue
        raise ConfigError(
            f"The {name} backend cannot {what}.",
            f"Use --backend {' or --backend '.join(able)}." if able else "No backend here can.",
        )
    backend = get_backend(name)
    assert isinstance(backend, ImageStore)  # made by the class checked above
    return backend


def cmd_images_build(args: argparse.Namespace) -> int:
    from ..backends import get_backend
    from ..payloads.manifest import load_manifest
    from .display import RunDisplay

    display = RunDisplay()
    extra: tuple[str, ...] = ()
    if args.payload:
        extra = load_manifest(args.payload).requirements
    tag = get_backend(args.backend).build_image(args.base, extra, display.progress)
    print(json.dumps({"image": tag}) if args.json else tag)
    return 0


def cmd_images_bootstrap(args: argparse.Namespace) -> int:
    from .display import RunDisplay

    backend = backend_that_can(args.backend, "bootstrap a base image")
    display = RunDisplay()
    tag = backend.bootstrap_base(suite=args.suite, mirror=args.mirror, progress=display.progress)
    print(json.dumps({"image": tag}) if args.json else tag)
    return 0


def cmd_images_list(args: argparse.Namespace) -> int:
    from datetime import datetime

    from .output import age, human_size, print_json, print_table, say

    images = backend_that_can(args.backend, "list images").list_images()
    if args.json:
        print_json(images)
        return 0
    if not images:
        say("no orchestrator images on this engine (build one with `orchestrator images build`)")
        return 0
    print_table(
        ("IMAGE", "KIND", "CREATED", "SIZE", "IN USE"),
        [
            (
                image["tag"],
                image["kind"],
                age(datetime.fromisoformat(image["created"]).timestamp()),
                human_size(image["size"]),
                "yes" if image["in_use"] else "no",
            )
            for image in images
        ],
        right=("SIZE",),
    )
    return 0


def cmd_images_prune(args: argparse.Namespace) -> int:
    from .output import print_json, say

    backend = backend_that_can(args.backend, "prune images")
    removed = backend.prune_images(dry_run=args.dry_run)
    if args.json:
        print_json({"removed": removed, "dry_run": args.dry_run})
        return 0
    for tag in removed:
        print(("would remove " if args.dry_run else "removed ") + tag)
    if not removed:
        say("nothing to prune: every orchestrator image is current or in use")
    return 0
