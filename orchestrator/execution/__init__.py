"""Where attempts run and how many at once: the executor seam and this host's executor
(`executor.py`), warm sandboxes (`pool.py`, handed out as a `claim.py` Claim), and the
adaptive limit (`concurrency.py`) fed by this host's measured load (`hostload.py`).

Batch, schedules and the Ray cluster hand their attempts here. May import `lifecycle` and
everything below it; never `batch`, `schedules`, `cluster`, `view` or `cli`.
"""
