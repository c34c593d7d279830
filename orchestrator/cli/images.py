"""`orchestrator images ...`: build, bootstrap, list and prune sandbox images."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..registry import backend_names, backends_help
from .parser import HELP


def add_images_parser(sub: Any) -> None:
    p = sub.add_parser("images", help=HELP["images"])
    isub = p.add_subparsers(title="images commands", metavar="ACTION")
    b = isub.add_parser(
        "build",
        help="build (or reuse) the agent image, and a payload's derived image",
        description="Build the agent image (Docker) or template (E2B) if it does not exist yet; "
        "prints its tag or template name. Content-addressed: unchanged inputs never rebuild.",
    )
    b.add_argument(
        "--payload", help="also build the derived image for this payload's requirements"
    )
    b.add_argument("--json", action="store_true", help="print {image} as JSON")
    b.add_argument(
        "--base",
        help="base image (docker default: $ORCHESTRATOR_BASE_IMAGE or python:3.12-slim; "
        "e2b default: $ORCHESTRATOR_E2B_BASE_IMAGE or python:3.12-slim)",
    )
    b.add_argument(
        "--backend", choices=backend_names(), default="docker",
        help=f"where the image is for: {backends_help()}",
    )  # fmt: skip
    b.set_defaults(handler=cmd_images_build)
    bb = isub.add_parser(
        "bootstrap-base",
        help="make a Debian base image with debootstrap + docker import (no registry needed)",
    )
    bb.add_argument("--suite", default="bookworm", help="Debian release to bootstrap")
    bb.add_argument("--mirror", default="http://deb.debian.org/debian", help="Debian mirror")
    bb.add_argument("--json", action="store_true", help="print {image} as JSON")
    bb.set_defaults(handler=cmd_images_bootstrap)
    ls = isub.add_parser("list", help="list orchestrator images")
    ls.add_argument("--json", action="store_true", help="print the images as a JSON array")
    ls.set_defaults(handler=cmd_images_list)
    pr = isub.add_parser("prune", help="remove orchestrator images that are no longer current")
    pr.add_argument("--dry-run", action="store_true", help="say what would go; remove nothing")
    pr.add_argument("--json", action="store_true", help="print the removed tags as JSON")
    pr.set_defaults(handler=cmd_images_prune)
    p.set_defaults(handler=lambda a: (p.print_help(), 2)[1])


def cmd_images_build(args: argparse.Namespace) -> int:
    from ..backends.docker.engine import connect
    from ..backends.docker.images import ensure_agent_image
    from ..manifest import load_manifest
    from .display import RunDisplay

    display = RunDisplay()
    extra: tuple[str, ...] = ()
    if args.payload:
        extra = load_manifest(args.payload).requirements
    if args.backend == "e2b":
        from dataclasses import replace

        from ..backends.e2b.settings import E2BSettings
        from ..backends.e2b.templates import ensure_template

        settings = E2BSettings.from_env()
        if args.base:
            settings = replace(settings, base_image=args.base)
        tag = ensure_template(settings, extra, progress=display.progress)
    else:
        tag = ensure_agent_image(
            connect(), base=args.base, extra_requirements=extra, progress=display.progress
        )
    print(json.dumps({"image": tag}) if args.json else tag)
    return 0


def cmd_images_bootstrap(args: argparse.Namespace) -> int:
    from ..backends.docker.base_image import bootstrap_base
    from ..backends.docker.engine import connect
    from .display import RunDisplay

    display = RunDisplay()
    tag = bootstrap_base(connect(), suite=args.suite, mirror=args.mirror, progress=display.progress)
    print(json.dumps({"image": tag}) if args.json else tag)
    return 0


def cmd_images_list(args: argparse.Namespace) -> int:
    from datetime import datetime

    from ..backends.docker.engine import connect
    from ..backends.docker.prune import list_images
    from .output import age, human_size, print_json, print_table, say

    images = list_images(connect())
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
    from ..backends.docker.engine import connect
    from ..backends.docker.prune import prune_images
    from .output import print_json

    removed = prune_images(connect(), dry_run=args.dry_run)
    if args.json:
        print_json({"removed": removed, "dry_run": args.dry_run})
        return 0
    for tag in removed:
        print(("would remove " if args.dry_run else "removed ") + tag)
    return 0
