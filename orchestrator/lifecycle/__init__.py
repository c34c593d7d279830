"""The life of one run, top to bottom (`runner.py`: prepare, execute, finish): its inputs
checked before anything exists (`prepared.py`), what its sandbox is asked for
(`request.py`), its image prepared once per cache (`imagecache.py`), its sandbox watched
(`supervise.py`), its end decided by the host (`outcome.py`), Ctrl-C honoured at safe points
(`interrupts.py`), and what dead runs left behind closed and removed (`cleanup.py`).

May import `records`, `backends`, `payloads`, `images` and the core modules; never
`execution` or anything above it (they call in here).
"""
