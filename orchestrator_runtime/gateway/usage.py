"""Token usage read from model responses as they pass through the gateway.

OpenAI-compatible servers (OpenAI, vLLM, llama.cpp, Ollama, Hugging Face's router) put
`usage: {prompt_tokens, completion_tokens}` in a JSON response, and in the last event of a
streamed one (`stream_options.include_usage`). Anthropic-style responses say
`input_tokens`/`output_tokens`, in a stream spread over `message_start` (input) and
`message_delta` (output so far). Gemini's say `usageMetadata: {promptTokenCount,
candidatesTokenCount, thoughtsTokenCount}` (thoughts are billed as output), in each streamed
chunk the running figures. Bedrock's converse says `usage: {inputTokens, outputTokens}`, and
its converse-stream (AWS's binary event stream, not server-sent events) the same in its last
event, `metadata`. Reading the last value seen of each field is right for all of them. The
model a call names is read from its request (`requested_model`): a batch's cost cap prices
each call by it.

Standard library only, but for botocore's event-stream parser (Bedrock's binary frames are
never parsed by hand), imported when such a stream comes.
"""

from __future__ import annotations

import json
from typing import Any

#: Response bytes kept to read a non-streamed body's usage; a larger body is still forwarded
#: whole, but its usage is unknown (recorded as such).
MAX_USAGE_BODY = 16 * 1024 * 1024
#: The longest SSE line looked at; a longer one is forwarded but not parsed.
MAX_SSE_LINE = 1024 * 1024
#: The longest model name recorded from a request.
MAX_MODEL_NAME = 200
#: AWS's binary event stream (Bedrock's converse-stream).
EVENT_STREAM = "application/vnd.amazon.eventstream"
#: Where Bedrock names the model: `/model/ID/converse` (an ID may hold `/`: an ARN).
BEDROCK_MODEL = "/model/"


def requested_model(body: bytes, path: str = "") -> str | None:
    """The model a call names: in its JSON body (`model`: OpenAI's and Anthropic's APIs both
    say it there; the provider bills that one), or in its `path` (Gemini's
    `/models/NAME:generateContent`, Bedrock's `/model/ID/converse`), cut to MAX_MODEL_NAME;
    None when it names none."""
    if path.startswith(BEDROCK_MODEL) and path.count("/") >= 3:  # Bedrock: in the path
        return path[len(BEDROCK_MODEL) :].rsplit("/", 1)[0][:MAX_MODEL_NAME] or None
    if "/models/" in path and ":" in path.rsplit("/", 1)[-1]:  # Gemini: in the path
        return path.rsplit("/", 1)[-1].split(":")[0][:MAX_MODEL_NAME] or None
    if b'"model"' not in body:  # no parse of a large body that names none
        return None
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    model = obj.get("model") if isinstance(obj, dict) else None
    return model[:MAX_MODEL_NAME] if isinstance(model, str) else None


def usage_of(obj: Any) -> tuple[int | None, int | None]:
    """(input, output) tokens of one response object or stream event, None where absent."""
    if not isinstance(obj, dict):
        return None, None
    gemini = obj.get("usageMetadata")  # Gemini's generateContent and each streamed chunk
    if isinstance(gemini, dict):
        prompt, candidates = (
            _count(gemini, "promptTokenCount"),
            _count(gemini, "candidatesTokenCount"),
        )
        thoughts = _count(gemini, "thoughtsTokenCount") or 0  # billed as output
        return prompt, None if candidates is None else candidates + thoughts
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        message = obj.get("message")  # Anthropic's `message_start` event
        usage = message.get("usage") if isinstance(message, dict) else None
    if not isinstance(usage, dict):
        return None, None

    def number(*names: str) -> int | None:
        for name in names:
            value = usage.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                return value
        return None

    return (
        number("prompt_tokens", "input_tokens", "inputTokens"),
        number("completion_tokens", "output_tokens", "outputTokens"),
    )


def _count(table: dict[str, Any], name: str) -> int | None:
    value = table.get(name)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


class UsageReader:
    """Fed the response body chunk by chunk (never holding up a chunk); `input_tokens` and
    `output_tokens` hold what the response said, None if it said nothing."""

    def __init__(self, content_type: str) -> None:
        lowered = content_type.lower()
        #: AWS's binary event stream: parsed by botocore, frame by frame.
        self.events = EVENT_STREAM in lowered
        self.streamed = "text/event-stream" in lowered or self.events
        self.input_tokens: int | None = None
        self.output_tokens: int | None = None
        self._buffer = bytearray()
        self._overflow = False
        self._frames: Any = None

    def feed(self, chunk: bytes) -> None:
        if self.events:
            self._feed_events(chunk)
            return
        if self._overflow:
            if self.streamed and b"\n" in chunk:  # resynchronise at the next line
                self._overflow = False
                chunk = chunk[chunk.index(b"\n") + 1 :]
            else:
                return
        self._buffer += chunk
        if self.streamed:
            *lines, rest = bytes(self._buffer).split(b"\n")
            self._buffer = bytearray(rest)
            for line in lines:
                self._line(line)
        limit = MAX_SSE_LINE if self.streamed else MAX_USAGE_BODY
        if len(self._buffer) > limit:
            self._buffer.clear()
            self._overflow = True

    def _feed_events(self, chunk: bytes) -> None:
        """Frames of AWS's event stream, each event's JSON payload read for usage. A stream
        botocore cannot parse (a bad checksum, a frame over its limits) is read no further:
        its usage is what came before."""
        if self._overflow:
            return
        try:
            if self._frames is None:
                from botocore.eventstream import EventStreamBuffer

                self._frames = EventStreamBuffer()
            self._frames.add_data(chunk)
            for message in self._frames:
                if message.headers.get(":message-type") == "event":
                    self._take(json.loads(message.payload))
        except Exception:  # botocore's ParserError, a payload that is not JSON
            self._overflow, self._frames = True, None

    def close(self) -> None:
        if self.events:
            self._frames = None
        elif self.streamed:
            self._line(bytes(self._buffer))
        elif not self._overflow:
            try:
                self._take(json.loads(self._buffer or b"null"))
            except ValueError:
                pass
        self._buffer.clear()

    def _line(self, line: bytes) -> None:
        line = line.strip()
        if not line.startswith(b"data:"):
            return
        data = line[5:].strip()
        if not data or data == b"[DONE]":
            return
        try:
            self._take(json.loads(data))
        except ValueError:
            pass

    def _take(self, obj: Any) -> None:
        input_tokens, output_tokens = usage_of(obj)
        if input_tokens is not None:
            self.input_tokens = input_tokens
        if output_tokens is not None:
            self.output_tokens = output_tokens
