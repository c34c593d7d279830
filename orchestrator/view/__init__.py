"""`orchestrator view`: a local web viewer over the run store (runs, a run's agent tree,
batches with their scores and charts, schedules), and a static export of the same pages.

`queries.py` the index's reads, `runs.py` one run's record, `tree.py` the agent tree from
events, `batches.py` batch folders and the store's batches, `schedules.py` the schedules
page's data, `charts.py` SVG charts, `render.py` Jinja2 pages and links, `security.py` the
token, Host check and Content-Security-Policy, `app.py` the Starlette app, `export.py`
the static export; `templates/` and `static/` ship inside the package (nothing from a CDN).
"""

from .app import create_app
from .batches import Batches
from .export import export
from .security import is_loopback, new_token

__all__ = ["Batches", "create_app", "export", "is_loopback", "new_token"]
