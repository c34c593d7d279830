"""Scheduled agent jobs: a TOML file of cron schedules, fired through the single-run API.

A *firing* is one decision of the scheduler: run the payload (prepared with
`lifecycle.runner.prepare` for `RunSpec(schedule=name)`, handed to an executor: a cold
sandbox on this host unless `serve` keeps one warm), or record why not (skipped: the previous
run still goes; missed: nobody was there to fire). Every firing is a row in
`schedule_firings`, in the same SQLite file as the runs, so a schedule's history survives
restarts and is shared by `serve`, cron lines and manual `schedule run` calls alike.

Overlap is prevented with a per-schedule file lock (flock): the OS drops it when the holder
dies, so a crash never leaves a schedule stuck. `replace` asks the holder to cancel its run
through a flag in the store, which the holder polls; this works across processes without
signalling anyone's pid (a `serve` process holds many schedules).

Time is injected (`Clock`), and so is the executor, so tests simulate hours instantly.

`cron.py` cron in a time zone, `file.py` the schedules file, `clock.py` time, `store.py`
history, `firing.py` one firing, `notify.py` notifications, `notify_table.py` a schedule's
`notify` table, `due.py` what is due, `serve.py` the foreground scheduler, `crontab.py`
system cron.
"""

from .clock import Clock, SystemClock
from .cron import Cron, local_iso, parse_duration
from .crontab import cron_times_field, crontab_block, install, merge_crontab
from .due import run_due
from .file import DEFAULT_FILE, Schedule, ScheduleFile, ScheduleFileError, load_schedules
from .firing import EXIT_SKIPPED, fire
from .serve import Scheduler
from .store import Firing, ScheduleStore

__all__ = [
    "DEFAULT_FILE",
    "EXIT_SKIPPED",
    "Clock",
    "Cron",
    "Firing",
    "Schedule",
    "ScheduleFile",
    "ScheduleFileError",
    "ScheduleStore",
    "Scheduler",
    "SystemClock",
    "crontab_block",
    "cron_times_field",
    "fire",
    "install",
    "load_schedules",
    "local_iso",
    "merge_crontab",
    "parse_duration",
    "run_due",
]
