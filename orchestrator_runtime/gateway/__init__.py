"""The per-run model gateway: the only place a run's model key exists while the run is live.

It runs in a container of its own (the agent image, hardened like the egress proxy, on the
run's private network and the default bridge), started by the host for runs whose model
talks HTTP (`orchestrator/backends/docker/gateway.py`). The sandbox gets a random run token
in place of the key and an `api_base` pointing here; the gateway checks the token, swaps it
for the key, forwards to the real endpoint, and tells the host about every call (status,
latency, tokens read from the response) and about the run's budget.

Why this component: a small ASGI forwarder (uvicorn, on httpx for the upstream side, TLS
included) passes server-sent events through unbuffered and reads usage from the bytes as they
go by, in about 300 lines we can test end to end. nginx from Debian swaps headers and proxies
TLS well but cannot read token usage out of response bodies without Lua scripting; LiteLLM's
proxy translates requests between providers (it is not a transparent pass-through), keeps
budgets in a database, and brings hundreds of megabytes of dependencies into the image.

Imports nothing from the host side (like the rest of `orchestrator_runtime`); httpx and
uvicorn are in the agent image.
"""
