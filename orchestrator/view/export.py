"""`orchestrator view --export DIR`: the same pages as static files that open from disk with
no server (to attach to a report or keep as a CI artifact). One flat folder: `index.html`
(the runs exported), `run-ID.html`, `batch-ID.html`, `batches.html`, `schedules.html` and
`static/` (the package's CSS and JS)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError
from ..records.store import Store
from .batches import Batches
from .queries import RunPage
from .render import Links, render
from .runs import load_run
from .schedules import schedules_page

STATIC = Path(__file__).parent / "static"


@dataclass
class Exported:
    folder: Path
    runs: list[str] = field(default_factory=list)
    batches: list[str] = field(default_factory=list)


def export(
    store: Store, folder: Path, items: list[str], schedules_file: Path | None = None
) -> Exported:
    """Write the pages of `items` (run ids or unique prefixes, and batch output folders; a
    batch brings its tasks' runs) to `folder`. Raises ConfigError (exit 2) naming an item
    that is neither, before anything is written."""
    if not items:
        raise ConfigError(
            "Nothing to export.", "Name run ids and/or batch output folders after --export DIR."
        )
    batches = Batches(store)
    run_ids: list[str] = []
    for item in items:
        if Path(item).is_dir():
            view = batches.get(batches.add(Path(item)))
            report = view.report if view else None
            run_ids += [r["run_id"] for r in (report.rows if report else []) if r.get("run_id")]
            continue
        row = store.get_run(item)
        if row is None:
            raise ConfigError(
                f"{item!r} is neither a run in this store nor a batch output folder.",
                "Give run ids (or unique prefixes) from `orchestrator runs list`, or folders "
                "passed to `orchestrator batch ... --output`.",
            )
        run_ids.append(row["run_id"])
    run_ids = list(dict.fromkeys(run_ids))
    links = Links(
        static=True,
        exported_runs=frozenset(run_ids),
        exported_batches=frozenset(batches.folders),
    )
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copytree(STATIC, folder / "static", dirs_exist_ok=True)
    rows = []
    for run_id in run_ids:
        run_view = load_run(store, run_id)
        if run_view is None:
            continue
        rows.append(run_view.row)
        page = render("run.html", links, run=run_view, live_url=None)
        (folder / f"run-{run_id}.html").write_text(page, encoding="utf-8")
    rows.sort(key=lambda r: r["created_at"], reverse=True)
    listing = RunPage(rows=rows, total=len(rows), page=1, pages=1)
    (folder / "index.html").write_text(
        render("runs.html", links, page=listing, flt=None), encoding="utf-8"
    )
    for batch_id in batches.folders:
        view = batches.get(batch_id)
        if view is not None:
            page = render("batch.html", links, view=view, others=[], labels={})
            (folder / f"batch-{batch_id}.html").write_text(page, encoding="utf-8")
    listing_b = [b for b in batches.listing() if b["batch"] in batches.folders]
    (folder / "batches.html").write_text(
        render("batches.html", links, batches=listing_b), encoding="utf-8"
    )
    (folder / "schedules.html").write_text(
        schedules_page(store, schedules_file, links), encoding="utf-8"
    )
    return Exported(folder, run_ids, list(batches.folders))
