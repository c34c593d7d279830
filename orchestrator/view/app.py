"""The viewer as a Starlette app: one route per page, a JSON endpoint a running run's page
polls, and the package's static files. Reads the store; never writes to it."""

from __future__ import annotations

import asyncio
from importlib.resources import files
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ..errors import OrchestratorError
from ..records.store import Store
from .batches import Batches
from .queries import RunFilter, list_runs
from .render import Links, render
from .runs import load_run
from .schedules import schedules_page
from .security import ASGIApp, Guard

STATIC = Path(str(files("orchestrator.view") / "static"))
LINKS = Links()


def not_found(what: str) -> HTMLResponse:
    return HTMLResponse(render("message.html", LINKS, title="Not found", message=what), 404)


def create_app(
    store: Store,
    batches: Batches | None = None,
    schedules_file: Path | None = None,
    token: str | None = None,
) -> ASGIApp:
    """The app, wrapped in its guard (`security.Guard`: loopback Host only, or `token`)."""
    batches = batches or Batches(store)

    async def page(function: Any, *args: Any) -> Any:
        """Store reads and file reads off the event loop (a page never blocks the others)."""
        return await asyncio.to_thread(function, *args)

    async def runs(request: Request) -> Response:
        flt = RunFilter.from_query(dict(request.query_params))
        try:
            result = await page(list_runs, store, flt)
        except OrchestratorError as exc:
            return HTMLResponse(
                render("message.html", LINKS, title="Bad filter", message=f"{exc.cause} {exc.fix}"),
                400,
            )
        return HTMLResponse(render("runs.html", LINKS, page=result, flt=flt))

    async def run(request: Request) -> Response:
        run_id = request.path_params["run_id"]
        view = await page(load_run, store, run_id)
        if view is None:
            return not_found(f"No run {run_id!r} in this store.")
        live = None if view.ended else f"/run/{view.row['run_id']}/live"
        return HTMLResponse(render("run.html", LINKS, run=view, live_url=live))

    async def run_live(request: Request) -> Response:
        view = await page(load_run, store, request.path_params["run_id"])
        if view is None:
            return JSONResponse({"error": "no such run"}, 404)
        html = render("run_body.html", LINKS, run=view)
        return JSONResponse({"status": view.row["status"], "ended": view.ended, "html": html})

    async def batch_list(request: Request) -> Response:
        return HTMLResponse(render("batches.html", LINKS, batches=await page(batches.listing)))

    async def batch(request: Request) -> Response:
        batch_id = request.path_params["batch_id"]
        view = await page(batches.get, batch_id)
        if view is None:
            return not_found(f"No batch {batch_id!r} in this store or the folders given.")
        others = [b for b in batches.folders if b != batch_id]
        labels = {b: batches.label(b) for b in others}
        return HTMLResponse(render("batch.html", LINKS, view=view, others=others, labels=labels))

    async def compare(request: Request) -> Response:
        a, b = request.query_params.get("a", ""), request.query_params.get("b", "")
        result = await page(batches.compare, a, b)
        if result is None:
            return not_found("Both batches must be output folders given to `orchestrator view`.")
        labels = {"a": batches.label(a), "b": batches.label(b)}
        return HTMLResponse(render("compare.html", LINKS, cmp=result, labels=labels))

    async def schedules(request: Request) -> Response:
        return HTMLResponse(await page(schedules_page, store, schedules_file, LINKS))

    app = Starlette(
        routes=[
            Route("/", runs),
            Route("/run/{run_id}", run),
            Route("/run/{run_id}/live", run_live),
            Route("/batches", batch_list),
            Route("/batch/{batch_id}", batch),
            Route("/compare", compare),
            Route("/schedules", schedules),
            Mount("/static", StaticFiles(directory=STATIC), name="static"),
        ]
    )
    return Guard(app, token)
