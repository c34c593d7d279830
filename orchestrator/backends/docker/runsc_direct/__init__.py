"""gVisor sandboxes driven through runsc itself (`--sandbox-runtime runsc-direct`): the Docker
engine still builds and stores the images; runsc runs each sandbox, restored from a snapshot,
without dockerd, containerd or a shim in the way (about 0.3 s, where the engine's restore
takes 0.7 s; `benchmarks/runsc_direct.py`).

The rooms, in the order a run meets them:

- binary.py    the runsc binary, its state root and every flag it is given;
- bundle.py    an image's root filesystem, exported once (content-addressed, read-only);
- ocispec.py   a sandbox's config.json: the engine path's hardening, as data;
- snapshot.py  the ready snapshot of a sandbox shape (`runsc checkpoint`), made once;
- cgroup.py    the sandbox's own cgroup: memory, CPU, pids; the OOM kill read from it;
- sandbox.py   one sandbox: `runsc restore` in the foreground, its pipes, exit, kill, removal;
- records.py   what the state directory knows of each sandbox (labels), for cleanup;
- direct.py    the runtime as the Docker backend offers it: a restore for a run without
               network; for a networked run (open, allowlist, gateway, bound secrets) a
               cold sandbox in the network namespace of a holder container (made by the
               Docker path, with its proxy, gateway and interceptor); list and remove for
               cleanup;
- head_start.py `orchestrator run`'s restore begun at the command's very start (the payload's
               last snapshot), taken by the run when it fits, else removed.

The guarantees are the engine path's: the same user, no capabilities, no-new-privileges,
our seccomp profile inside gVisor, tmpfs /tmp and /work with their sizes, memory, CPU and
pids limits, no log of the output; the deadline keeper as PID 1 of every sandbox (inside
the snapshot: it stops the sandbox on time with no orchestrator process left), and the
labels cleanup reads, kept in records.py's files since the engine keeps none for these.
"""
