"""The control-plane REST API (api.e2b.app): create, list, get, kill, timeout, connect."""

from __future__ import annotations

import asyncio
import functools
import json
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .cloud import ApiError, FakeE2BCloud

Handler = Callable[[Request], Awaitable[Response]]


def error_response(error: ApiError) -> JSONResponse:
    """E2B's error body: {"code": status, "message": ...}."""
    return JSONResponse(
        {"code": error.status, "message": error.message},
        status_code=error.status,
        headers=error.headers,
    )


def parse_metadata_filter(raw: str | None) -> dict[str, str]:
    """Decode the SDK's `metadata` query value: urlencoded pairs of percent-encoded text."""
    if not raw:
        return {}
    pairs = urllib.parse.parse_qsl(raw, keep_blank_values=True)
    return {urllib.parse.unquote(k): urllib.parse.unquote(v) for k, v in pairs}


async def json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except ValueError:
        raise ApiError(400, "request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body


def api_app(cloud: FakeE2BCloud) -> Starlette:
    """The control-plane ASGI app; every route checks `X-API-KEY`."""

    def guarded(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def wrapper(request: Request) -> Response:
            if request.headers.get("x-api-key") != cloud.api_key:
                return error_response(ApiError(401, "Invalid API key, please check your key"))
            try:
                return await handler(request)
            except ApiError as e:
                return error_response(e)

        return wrapper

    async def create(request: Request) -> Response:
        body = await json_body(request)
        sandbox = await asyncio.to_thread(cloud.create, body)
        return JSONResponse(sandbox.created_json(cloud.envd_version), status_code=201)

    async def list_sandboxes(request: Request) -> Response:
        metadata = parse_metadata_filter(request.query_params.get("metadata"))
        states = [s for s in request.query_params.get("state", "").split(",") if s]
        found = cloud.list_running(metadata, states)
        offset = int(request.query_params.get("nextToken") or 0)
        limit = int(request.query_params.get("limit") or 100)
        page = found[offset : offset + limit]
        headers = {}
        if offset + limit < len(found):
            headers["x-next-token"] = str(offset + limit)
        items = [s.listed_json(cloud.envd_version) for s in page]
        return JSONResponse(items, headers=headers)

    async def get(request: Request) -> Response:
        sandbox = cloud.get(request.path_params["sandbox_id"])
        return JSONResponse(sandbox.detail_json(cloud.envd_version))

    async def kill(request: Request) -> Response:
        await asyncio.to_thread(cloud.delete, request.path_params["sandbox_id"])
        return Response(status_code=204)

    async def set_timeout(request: Request) -> Response:
        body = await json_body(request)
        timeout = body.get("timeout")
        if not isinstance(timeout, int) or timeout < 0:
            raise ApiError(400, "timeout must be a non-negative integer")
        cloud.set_timeout(request.path_params["sandbox_id"], timeout)
        return Response(status_code=204)

    async def connect(request: Request) -> Response:
        body = await json_body(request)
        timeout = body.get("timeout")
        sandbox = cloud.connect(
            request.path_params["sandbox_id"], timeout if isinstance(timeout, int) else None
        )
        return JSONResponse(sandbox.created_json(cloud.envd_version), status_code=200)

    async def refresh(request: Request) -> Response:
        cloud.get(request.path_params["sandbox_id"])
        return Response(status_code=204)

    async def metrics(request: Request) -> Response:
        cloud.get(request.path_params["sandbox_id"])
        return JSONResponse([])

    async def not_found(request: Request) -> Response:
        return error_response(ApiError(404, f"{request.method} {request.url.path} not found"))

    routes = [
        Route("/sandboxes", guarded(create), methods=["POST"]),
        Route("/v2/sandboxes", guarded(create), methods=["POST"]),
        Route("/sandboxes", guarded(list_sandboxes), methods=["GET"]),
        Route("/v2/sandboxes", guarded(list_sandboxes), methods=["GET"]),
        Route("/sandboxes/{sandbox_id}", guarded(get), methods=["GET"]),
        Route("/sandboxes/{sandbox_id}", guarded(kill), methods=["DELETE"]),
        Route("/sandboxes/{sandbox_id}/timeout", guarded(set_timeout), methods=["POST"]),
        Route("/sandboxes/{sandbox_id}/connect", guarded(connect), methods=["POST"]),
        Route("/v2/sandboxes/{sandbox_id}/connect", guarded(connect), methods=["POST"]),
        Route("/sandboxes/{sandbox_id}/refreshes", guarded(refresh), methods=["POST"]),
        Route("/sandboxes/{sandbox_id}/metrics", guarded(metrics), methods=["GET"]),
        Route("/{path:path}", not_found, methods=["GET", "POST", "PUT", "PATCH", "DELETE"]),
    ]
    return Starlette(routes=routes)
