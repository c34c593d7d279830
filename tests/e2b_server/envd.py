"""envd, the in-sandbox agent: `/health`, `/files` and the Connect-RPC services.

Requests reach it through the sandbox proxy gate (`EnvdApp`), which routes by the
`E2b-Sandbox-Id` header, answers 502 for sandboxes that are gone (like E2B's proxy) and
checks `X-Access-Token` against the sandbox's envd access token.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import posixpath
from collections.abc import AsyncIterator, Mapping
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from e2b.envd.filesystem import filesystem_connect, filesystem_pb
from e2b.envd.process import process_connect, process_pb
from protobuf import Oneof
from protobuf.wkt import Timestamp
from starlette.applications import Starlette
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from .cloud import FakeE2BCloud, Sandbox, StartedCommand
from .docker_sandbox import ContainerGone, ExecResult, UserInfo
from .processes import ManagedProcess, SandboxGone, keepalive_event, launch, start_event

SANDBOX_HEADER = "e2b-sandbox-id"
TOKEN_HEADER = "x-access-token"
KEEPALIVE_HEADER = "keepalive-ping-interval"


def not_found_message(sandbox_id: str) -> str:
    """The proxy's message for a sandbox that is gone (the SDK matches "was not found")."""
    return f"The sandbox {sandbox_id} was not found"


def sandbox_gone(sandbox_id: str) -> ConnectError:
    return ConnectError(Code.UNAVAILABLE, not_found_message(sandbox_id))


def stream_cut(sandbox_id: str) -> ConnectError:
    """What a stream ends with when its sandbox dies mid-command."""
    return ConnectError(
        Code.UNAVAILABLE,
        f"the connection to sandbox {sandbox_id} ended before the stream completed",
    )


def basic_auth_user(header: str | None) -> str | None:
    """The user named by envd's `Authorization: Basic base64("user:")` header."""
    if not header or not header.lower().startswith("basic "):
        return None
    try:
        decoded = base64.b64decode(header.split(" ", 1)[1]).decode()
    except ValueError:
        return None
    return decoded.split(":", 1)[0] or None


def resolve_path(path: str, user: UserInfo) -> str:
    """Expand `~` and make `path` absolute relative to the user's home, like envd."""
    if path == "~" or path.startswith("~/"):
        path = user.home + path[1:]
    if not path.startswith("/"):
        path = posixpath.join(user.home, path)
    return posixpath.normpath(path)


def process_env(sandbox: Sandbox, user: UserInfo, envs: Mapping[str, str]) -> dict[str, str]:
    """envd's environment: PATH, HOME, USER, LOGNAME, the sandbox's envVars, the command's."""
    assert sandbox.container is not None
    env = {
        "PATH": sandbox.container.image_path,
        "HOME": user.home,
        "USER": user.name,
        "LOGNAME": user.name,
    }
    env.update(sandbox.env_vars)
    env.update(envs)
    return env


def rpc_sandbox(cloud: FakeE2BCloud, ctx: RequestContext[Any, Any]) -> Sandbox:
    """The running sandbox an RPC is addressed to (UNAVAILABLE if it is gone)."""
    sandbox_id = ctx.request_headers.get(SANDBOX_HEADER, "")
    sandbox = cloud.running(sandbox_id)
    if sandbox is None or sandbox.container is None:
        raise sandbox_gone(sandbox_id)
    return sandbox


async def rpc_user(
    cloud: FakeE2BCloud, sandbox: Sandbox, ctx: RequestContext[Any, Any]
) -> UserInfo:
    """The user an RPC runs as: from `Authorization: Basic`, else the default user."""
    name = basic_auth_user(ctx.request_headers.get("authorization"))
    try:
        return await asyncio.to_thread(cloud.resolve_user, sandbox, name)
    except KeyError:
        raise ConnectError(Code.UNAUTHENTICATED, f"invalid username: '{name}'") from None
    except ContainerGone:
        raise sandbox_gone(sandbox.sandbox_id) from None


# -- process.Process ---------------------------------------------------------------------


class ProcessService(process_connect.Process):
    """envd's process service on top of `docker exec`."""

    def __init__(self, cloud: FakeE2BCloud) -> None:
        self.cloud = cloud

    def _find(
        self, sandbox: Sandbox, selector: process_pb.ProcessSelector | None
    ) -> ManagedProcess:
        processes = self.cloud.processes(sandbox)
        match selector.selector if selector is not None else None:
            case Oneof(field="pid", value=pid):
                process = next((p for p in processes if p.pid == pid), None)
            case Oneof(field="tag", value=tag):
                process = next((p for p in processes if p.tag == tag), None)
            case _:
                raise ConnectError(Code.INVALID_ARGUMENT, "invalid process selector")
        if process is None:
            raise ConnectError(Code.NOT_FOUND, "process not found")
        return process

    async def _events(
        self, sandbox: Sandbox, queue: asyncio.Queue[Any], ctx: RequestContext[Any, Any]
    ) -> AsyncIterator[process_pb.ProcessEvent]:
        interval = ctx.request_headers.get(KEEPALIVE_HEADER)
        keepalive = float(interval) if interval and interval.isdigit() else None
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), keepalive)
            except asyncio.TimeoutError:
                yield keepalive_event()
                continue
            if isinstance(item, SandboxGone):
                raise stream_cut(sandbox.sandbox_id)
            yield item
            if item.event is not None and item.event.field == "end":
                return

    async def list(
        self, request: process_pb.ListRequest, ctx: RequestContext[Any, Any]
    ) -> process_pb.ListResponse:
        sandbox = rpc_sandbox(self.cloud, ctx)
        return process_pb.ListResponse(processes=[p.info() for p in self.cloud.processes(sandbox)])

    async def start(
        self, request: process_pb.StartRequest, ctx: RequestContext[Any, Any]
    ) -> AsyncIterator[process_pb.StartResponse]:
        sandbox = rpc_sandbox(self.cloud, ctx)
        if request.pty is not None:
            raise ConnectError(Code.UNIMPLEMENTED, "PTY is not supported by the E2B test server")
        config = request.process or process_pb.ProcessConfig()
        user = await rpc_user(self.cloud, sandbox, ctx)
        assert sandbox.container is not None
        default_cwd = sandbox.container.image_workdir or user.home
        cwd = resolve_path(config.cwd if config.has_field("cwd") else default_cwd, user)
        envs = dict(config.envs)
        stdin = request.stdin if request.has_field("stdin") else True
        tag = request.tag if request.has_field("tag") else None
        timeout_ms = ctx.timeout_ms
        argv = [config.cmd, *config.args]
        try:
            stream, frames, pid, early = await asyncio.to_thread(
                launch,
                sandbox.container,
                argv,
                user=user,
                cwd=cwd,
                env=process_env(sandbox, user, envs),
                stdin=stdin,
            )
        except ContainerGone:
            raise sandbox_gone(sandbox.sandbox_id) from None
        except ConnectError:
            if not self.cloud.is_running(sandbox):
                raise sandbox_gone(sandbox.sandbox_id) from None
            raise
        self.cloud.commands.append(
            StartedCommand(
                sandbox.sandbox_id, pid, config.cmd, list(config.args), envs, cwd, user.name
            )
        )
        process = ManagedProcess(
            container=sandbox.container,
            stream=stream,
            frames=frames,
            pid=pid,
            config=config,
            tag=tag,
            early=early,
            sandbox_alive=lambda: self.cloud.is_running(sandbox),
            on_exit=lambda p: self.cloud.unregister_process(sandbox, p),
        )
        self.cloud.register_process(sandbox, process)
        queue = process.subscribe()
        process.start_pump(timeout_ms / 1000 if timeout_ms and timeout_ms > 0 else None)
        try:
            yield process_pb.StartResponse(event=start_event(pid))
            async for event in self._events(sandbox, queue, ctx):
                yield process_pb.StartResponse(event=event)
        finally:
            process.unsubscribe(queue)

    async def connect(
        self, request: process_pb.ConnectRequest, ctx: RequestContext[Any, Any]
    ) -> AsyncIterator[process_pb.ConnectResponse]:
        sandbox = rpc_sandbox(self.cloud, ctx)
        process = self._find(sandbox, request.process)
        queue = process.subscribe()
        try:
            yield process_pb.ConnectResponse(event=start_event(process.pid))
            async for event in self._events(sandbox, queue, ctx):
                yield process_pb.ConnectResponse(event=event)
        finally:
            process.unsubscribe(queue)

    async def send_signal(
        self, request: process_pb.SendSignalRequest, ctx: RequestContext[Any, Any]
    ) -> process_pb.SendSignalResponse:
        sandbox = rpc_sandbox(self.cloud, ctx)
        process = self._find(sandbox, request.process)
        names = {process_pb.Signal.SIGKILL: "KILL", process_pb.Signal.SIGTERM: "TERM"}
        name = names.get(request.signal)
        if name is None:
            raise ConnectError(Code.INVALID_ARGUMENT, f"invalid signal: {request.signal}")
        await asyncio.to_thread(process.signal, name)
        return process_pb.SendSignalResponse()

    async def _write(self, process: ManagedProcess, data: bytes) -> None:
        try:
            await asyncio.to_thread(process.write_stdin, data)
        except OSError as e:
            raise ConnectError(Code.FAILED_PRECONDITION, f"error writing to stdin: {e}") from e

    async def send_input(
        self, request: process_pb.SendInputRequest, ctx: RequestContext[Any, Any]
    ) -> process_pb.SendInputResponse:
        sandbox = rpc_sandbox(self.cloud, ctx)
        process = self._find(sandbox, request.process)
        match request.input.input if request.input is not None else None:
            case Oneof(field="stdin", value=data):
                await self._write(process, data)
            case _:
                raise ConnectError(Code.INVALID_ARGUMENT, "only stdin input is supported")
        return process_pb.SendInputResponse()

    async def stream_input(
        self,
        request: AsyncIterator[process_pb.StreamInputRequest],
        ctx: RequestContext[Any, Any],
    ) -> process_pb.StreamInputResponse:
        sandbox = rpc_sandbox(self.cloud, ctx)
        process: ManagedProcess | None = None
        async for message in request:
            match message.event:
                case Oneof(value=process_pb.StreamInputRequest.StartEvent() as start):
                    process = self._find(sandbox, start.process)
                case Oneof(value=process_pb.StreamInputRequest.DataEvent() as data) if process:
                    match data.input.input if data.input is not None else None:
                        case Oneof(field="stdin", value=bytes() as chunk):
                            await self._write(process, chunk)
        return process_pb.StreamInputResponse()

    async def close_stdin(
        self, request: process_pb.CloseStdinRequest, ctx: RequestContext[Any, Any]
    ) -> process_pb.CloseStdinResponse:
        sandbox = rpc_sandbox(self.cloud, ctx)
        process = self._find(sandbox, request.process)
        await asyncio.to_thread(process.close_stdin)
        return process_pb.CloseStdinResponse()


# -- filesystem.Filesystem ---------------------------------------------------------------

_FIND_FORMAT = "%p\\0%y\\0%Y\\0%s\\0%m\\0%M\\0%u\\0%g\\0%T@\\0%l\\0"
_FIELDS = 10
_TYPES = {"f": filesystem_pb.FileType.FILE, "d": filesystem_pb.FileType.DIRECTORY}


def _entries(output: bytes) -> list[filesystem_pb.EntryInfo]:
    """Parse `find -printf _FIND_FORMAT` output into envd entries."""
    parts = output.decode(errors="replace").split("\0")[:-1]
    entries = []
    for i in range(0, len(parts) - _FIELDS + 1, _FIELDS):
        path, kind, target_kind, size, mode, perms, owner, group, mtime, link = parts[
            i : i + _FIELDS
        ]
        is_symlink = kind == "l"
        file_type = _TYPES.get(target_kind if is_symlink else kind)
        if file_type is None and is_symlink:
            file_type = filesystem_pb.FileType.SYMLINK
        go_mode = int(mode, 8) | (1 << 31 if kind == "d" else 0) | (1 << 27 if is_symlink else 0)
        seconds, _, fraction = mtime.partition(".")
        entries.append(
            filesystem_pb.EntryInfo(
                name=posixpath.basename(path) or path,
                type=file_type or filesystem_pb.FileType.UNSPECIFIED,
                path=path,
                size=int(size),
                mode=go_mode,
                permissions=perms,
                owner=owner,
                group=group,
                modified_time=Timestamp(
                    seconds=int(seconds), nanos=int((fraction + "000000000")[:9])
                ),
                symlink_target=link if is_symlink else None,
                is_symlink=is_symlink,
            )
        )
    return entries


def _fs_error(result: ExecResult, path: str) -> ConnectError:
    message = result.stderr.decode(errors="replace").strip() or f"failed on '{path}'"
    if "No such file" in message:
        return ConnectError(Code.NOT_FOUND, f"path '{path}' does not exist")
    if "Permission denied" in message:
        return ConnectError(Code.PERMISSION_DENIED, message)
    return ConnectError(Code.INTERNAL, message)


class FilesystemService(filesystem_connect.Filesystem):
    """envd's filesystem service; every operation runs in the sandbox as the caller's user."""

    def __init__(self, cloud: FakeE2BCloud) -> None:
        self.cloud = cloud

    async def _run(
        self, ctx: RequestContext[Any, Any], path: str, argv: list[str]
    ) -> tuple[ExecResult, str, Sandbox, UserInfo]:
        """Run argv (with "{path}" replaced by the resolved path) as the caller."""
        sandbox = rpc_sandbox(self.cloud, ctx)
        user = await rpc_user(self.cloud, sandbox, ctx)
        resolved = resolve_path(path, user)
        assert sandbox.container is not None
        command = [resolved if a == "{path}" else a for a in argv]
        try:
            result = await asyncio.to_thread(sandbox.container.run, command, user=user.docker_user)
        except ContainerGone:
            raise sandbox_gone(sandbox.sandbox_id) from None
        return result, resolved, sandbox, user

    async def _stat(self, ctx: RequestContext[Any, Any], path: str) -> filesystem_pb.EntryInfo:
        result, resolved, _, _ = await self._run(
            ctx, path, ["find", "{path}", "-maxdepth", "0", "-printf", _FIND_FORMAT]
        )
        entries = _entries(result.stdout)
        if result.exit_code != 0 or not entries:
            raise _fs_error(result, resolved)
        return entries[0]

    async def stat(
        self, request: filesystem_pb.StatRequest, ctx: RequestContext[Any, Any]
    ) -> filesystem_pb.StatResponse:
        return filesystem_pb.StatResponse(entry=await self._stat(ctx, request.path))

    async def list_dir(
        self, request: filesystem_pb.ListDirRequest, ctx: RequestContext[Any, Any]
    ) -> filesystem_pb.ListDirResponse:
        entry = await self._stat(ctx, request.path)
        if entry.type != filesystem_pb.FileType.DIRECTORY:
            raise ConnectError(Code.INVALID_ARGUMENT, f"path '{entry.path}' is not a directory")
        depth = str(request.depth or 1)
        argv = [
            "find",
            "-H",
            "{path}",
            "-mindepth",
            "1",
            "-maxdepth",
            depth,
            "-printf",
            _FIND_FORMAT,
        ]
        result, resolved, _, _ = await self._run(ctx, entry.path, argv)
        if result.exit_code != 0:
            raise _fs_error(result, resolved)
        return filesystem_pb.ListDirResponse(entries=_entries(result.stdout))

    async def make_dir(
        self, request: filesystem_pb.MakeDirRequest, ctx: RequestContext[Any, Any]
    ) -> filesystem_pb.MakeDirResponse:
        script = (
            'if [ -d "$1" ]; then exit 17; elif [ -e "$1" ]; then exit 20; fi; mkdir -p -- "$1"'
        )
        result, resolved, _, _ = await self._run(
            ctx, request.path, ["/bin/sh", "-c", script, "mkdir", "{path}"]
        )
        if result.exit_code == 17:
            raise ConnectError(Code.ALREADY_EXISTS, f"directory '{resolved}' already exists")
        if result.exit_code == 20:
            raise ConnectError(
                Code.INVALID_ARGUMENT, f"path '{resolved}' already exists and is not a directory"
            )
        if result.exit_code != 0:
            raise _fs_error(result, resolved)
        return filesystem_pb.MakeDirResponse(entry=await self._stat(ctx, resolved))

    async def remove(
        self, request: filesystem_pb.RemoveRequest, ctx: RequestContext[Any, Any]
    ) -> filesystem_pb.RemoveResponse:
        script = '[ -e "$1" ] || [ -L "$1" ] || exit 2; rm -rf -- "$1"'
        result, resolved, _, _ = await self._run(
            ctx, request.path, ["/bin/sh", "-c", script, "rm", "{path}"]
        )
        if result.exit_code == 2:
            raise ConnectError(Code.NOT_FOUND, f"path '{resolved}' does not exist")
        if result.exit_code != 0:
            raise _fs_error(result, resolved)
        return filesystem_pb.RemoveResponse()

    async def move(
        self, request: filesystem_pb.MoveRequest, ctx: RequestContext[Any, Any]
    ) -> filesystem_pb.MoveResponse:
        sandbox = rpc_sandbox(self.cloud, ctx)
        user = await rpc_user(self.cloud, sandbox, ctx)
        destination = resolve_path(request.destination, user)
        script = (
            '[ -e "$1" ] || [ -L "$1" ] || exit 2; '
            'mkdir -p -- "$(dirname -- "$2")" && mv -T -- "$1" "$2"'
        )
        result, resolved, _, _ = await self._run(
            ctx, request.source, ["/bin/sh", "-c", script, "mv", "{path}", destination]
        )
        if result.exit_code == 2:
            raise ConnectError(Code.NOT_FOUND, f"path '{resolved}' does not exist")
        if result.exit_code != 0:
            raise _fs_error(result, resolved)
        return filesystem_pb.MoveResponse(entry=await self._stat(ctx, destination))


# -- HTTP: /health and /files --------------------------------------------------------------


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)


def files_app(cloud: FakeE2BCloud) -> Starlette:
    """envd's plain HTTP API."""

    async def context(request: Request) -> tuple[Sandbox, UserInfo] | Response:
        sandbox_id = request.headers.get(SANDBOX_HEADER, "")
        sandbox = cloud.running(sandbox_id)
        if sandbox is None or sandbox.container is None:
            return _error(502, not_found_message(sandbox_id))
        name = request.query_params.get("username") or None
        try:
            user = await asyncio.to_thread(cloud.resolve_user, sandbox, name)
        except KeyError:
            return _error(401, f"invalid username: '{name}'")
        except ContainerGone:
            return _error(502, not_found_message(sandbox_id))
        return sandbox, user

    async def health(request: Request) -> Response:
        return Response(status_code=204)

    async def download(request: Request) -> Response:
        found = await context(request)
        if isinstance(found, Response):
            return found
        sandbox, user = found
        path = resolve_path(request.query_params.get("path", ""), user)
        assert sandbox.container is not None
        try:
            data = await asyncio.to_thread(sandbox.container.get_file, path)
        except FileNotFoundError:
            return _error(404, f"path '{path}' does not exist")
        except IsADirectoryError:
            return _error(400, f"path '{path}' is a directory")
        except ContainerGone:
            return _error(502, not_found_message(sandbox.sandbox_id))
        name = posixpath.basename(path)
        return Response(
            data,
            media_type="application/octet-stream",
            headers={"Content-Disposition": f'attachment; filename="{name}"'},
        )

    async def upload(request: Request) -> Response:
        found = await context(request)
        if isinstance(found, Response):
            return found
        sandbox, user = found
        path_param = request.query_params.get("path")
        files: list[tuple[str, bytes]] = []
        if request.headers.get("content-type", "").startswith("multipart/form-data"):
            async with request.form(max_files=100_000) as form:
                uploads = [v for k, v in form.multi_items() if k == "file"]
                for upload in uploads:
                    if not isinstance(upload, UploadFile):
                        return _error(400, "file field is not a file")
                    single = path_param and len(uploads) == 1
                    destination = path_param if single else upload.filename
                    if not destination:
                        return _error(400, "missing file path")
                    files.append((resolve_path(destination, user), await upload.read()))
        else:
            if not path_param:
                return _error(400, "missing 'path' query parameter")
            data = await request.body()
            if request.headers.get("content-encoding", "").lower() == "gzip":
                data = gzip.decompress(data)
            files.append((resolve_path(path_param, user), data))
        if not files:
            return _error(400, "no files in the request")
        assert sandbox.container is not None
        try:
            await asyncio.to_thread(sandbox.container.put_files, files, user)
        except PermissionError as e:
            return _error(403, f"permission denied: {e}")
        except ContainerGone:
            return _error(502, not_found_message(sandbox.sandbox_id))
        metadata = {
            k[len("x-metadata-") :].lower(): v
            for k, v in request.headers.items()
            if k.lower().startswith("x-metadata-")
        }
        written = []
        for path, _ in files:
            info: dict[str, Any] = {"name": posixpath.basename(path), "type": "file", "path": path}
            if metadata:
                info["metadata"] = metadata
            written.append(info)
        return JSONResponse(written)

    return Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/files", download, methods=["GET"]),
            Route("/files", upload, methods=["POST"]),
        ]
    )


async def send_json(send: Send, status: int, payload: Any) -> None:
    """Answer a raw ASGI request with a JSON body."""
    body = json.dumps(payload).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": body})


class EnvdApp:
    """The sandbox proxy plus envd: routes by sandbox id, checks the access token."""

    def __init__(self, cloud: FakeE2BCloud) -> None:
        self.cloud = cloud
        self.process = process_connect.ProcessASGIApplication(ProcessService(cloud))
        self.filesystem = filesystem_connect.FilesystemASGIApplication(FilesystemService(cloud))
        self.http = files_app(cloud)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = {k.decode().lower(): v.decode() for k, v in scope.get("headers", [])}
        sandbox_id = headers.get(SANDBOX_HEADER, "")
        sandbox = self.cloud.running(sandbox_id)
        if sandbox is None:
            await send_json(
                send,
                502,
                {"code": 502, "message": not_found_message(sandbox_id), "sandboxId": sandbox_id},
            )
            return
        path = scope["path"]
        if path != "/health" and headers.get(TOKEN_HEADER) != sandbox.access_token:
            await send_json(send, 401, {"code": 401, "message": "invalid access token"})
            return
        if path.startswith(self.process.path + "/"):
            await self.process(scope, receive, send)
        elif path.startswith(self.filesystem.path + "/"):
            await self.filesystem(scope, receive, send)
        else:
            await self.http(scope, receive, send)
