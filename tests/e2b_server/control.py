"""The control-plane REST API (api.e2b.app): sandboxes (create, list, get, kill, timeout,
connect) and template builds (request, file uploads, start, status)."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .cloud import ApiError, FakeE2BCloud
from .templates import MAX_LOG_ENTRIES, UPLOAD_PREFIX

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


def int_param(request: Request, name: str, default: int) -> int:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ApiError(400, f"query parameter {name} must be an integer") from None


def api_app(cloud: FakeE2BCloud) -> Starlette:
    """The control-plane ASGI app; every route checks `X-API-KEY`, but the upload URLs,
    which are presigned like E2B's S3 URLs (the SDK sends no key there)."""

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

    builds = cloud.template_builds

    async def template_alias(request: Request) -> Response:
        return JSONResponse(builds.alias(request.path_params["alias"]))

    async def request_template(request: Request) -> Response:
        body = await json_body(request)
        return JSONResponse(builds.request(body), status_code=202)

    async def file_upload_link(request: Request) -> Response:
        link = builds.upload_link(
            request.path_params["template_id"],
            request.path_params["files_hash"],
            str(request.base_url),
        )
        return JSONResponse(link, status_code=201)

    async def upload(request: Request) -> Response:
        """The presigned PUT of a COPY step's tar (gzipped or not), checked by its token."""
        try:
            target = builds.upload_target(
                request.path_params["template_id"],
                request.path_params["files_hash"],
                request.query_params.get("token", ""),
            )
        except ApiError as e:
            return error_response(e)
        partial = f"{target}.{os.getpid()}.{id(request)}.part"
        try:
            with open(partial, "wb") as out:
                async for chunk in request.stream():
                    out.write(chunk)
            os.replace(partial, target)
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
        return Response(status_code=200)

    async def start_build(request: Request) -> Response:
        body = await json_body(request)
        builds.start(request.path_params["template_id"], request.path_params["build_id"], body)
        return Response(status_code=202)

    async def build_status(request: Request) -> Response:
        status = builds.status(
            request.path_params["template_id"],
            request.path_params["build_id"],
            offset=int_param(request, "logsOffset", 0),
            limit=int_param(request, "limit", MAX_LOG_ENTRIES),
            level=request.query_params.get("level") or None,
        )
        return JSONResponse(status)

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
        Route("/templates/aliases/{alias:path}", guarded(template_alias), methods=["GET"]),
        Route("/v3/templates", guarded(request_template), methods=["POST"]),
        Route(
            "/templates/{template_id}/files/{files_hash}",
            guarded(file_upload_link),
            methods=["GET"],
        ),
        Route(UPLOAD_PREFIX + "{template_id}/{files_hash}", upload, methods=["PUT"]),
        Route(
            "/v2/templates/{template_id}/builds/{build_id}",
            guarded(start_build),
            methods=["POST"],
        ),
        Route(
            "/templates/{template_id}/builds/{build_id}/status",
            guarded(build_status),
            methods=["GET"],
        ),
        Route("/{path:path}", not_found, methods=["GET", "POST", "PUT", "PATCH", "DELETE"]),
    ]
    return Starlette(routes=routes)
