"""The judge of `--scorer model`: a model that grades an answer against the expected one, asked
on the host through a model gateway of the batch's own, and its grades kept in the batch folder.

The judge's key never leaves the host's memory: it is read like a run's secrets (the
environment, then `.env`), handed to a gateway (`orchestrator_runtime.gateway.app.Gateway`,
the same code a run's sidecar runs) that is served in this process, one per call, through
httpx's ASGI transport: the call carries a random token, the gateway swaps it for the key,
forwards to the judge's endpoint and measures the call's tokens (its `model_call` event), which
the batch counts in its spend. No sandbox, record, file or environment variable ever holds
the key; a scorer of the user's runs beside it and gets answers, never the key.

The grading template is Inspect AI's `model_graded_fact` in spirit: the question, the expected
answer and the submitted one; the judge ends with `GRADE: C` (correct), `GRADE: P` (partly)
or `GRADE: I` (incorrect). A reply without a grade is unscored, with the reason, never a 0.

`judge.jsonl` (the grade cache): one line per judge call, keyed by (answer, expected,
template, judge), with the judge's full text, the grade parsed, its tokens and cost; a
`batch rescore` with the same judge and template reads grades from it and pays nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import secrets as random_tokens
import threading
import time
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from orchestrator_runtime.masking import Masker

from ..errors import ConfigError
from ..models import ModelSpec, parse_model
from ..payloads.secrets import resolve_secrets
from .prices import Pricing

#: The grade cache's file in the batch folder.
JUDGE_FILE = "judge.jsonl"

#: What a grade letter scores.
GRADES = {"C": 1.0, "P": 0.5, "I": 0.0}

#: The grade in the judge's reply (its last one counts: the template asks it to end with it).
GRADE_PATTERN = re.compile(r"GRADE\s*:\s*\**\s*([CPI])\b", re.IGNORECASE)

#: The fields a template fills in (others, and any other braces, are left as written).
FIELDS = ("question", "expected", "answer")

DEFAULT_TEMPLATE = """\
You are comparing a submitted answer to an expert answer on a given question. Here is the data:

[BEGIN DATA]
************
[Question]: {question}
************
[Expert]: {expected}
************
[Submission]: {answer}
************
[END DATA]

Compare the factual content of the submitted answer with the expert answer. Ignore any \
differences in style, grammar, or punctuation.

Does the submission contain the content in the expert answer?

After assessing the submitted answer, reply with 'GRADE: $LETTER' (without quotes) where \
LETTER is one of CI. Please choose ONE option for the grade: either "C" for correct answers, \
or "I" for incorrect answers.

For example, after reviewing a correct answer you might write 'GRADE: C' or after reviewing \
an incorrect answer you might write 'GRADE: I'.

First, write out in a step by step manner your reasoning about the criterion to be sure that \
your conclusion is correct. Avoid simply stating the correct answers at the outset. Then, end \
with your answer formatted as 'GRADE: $LETTER' (without quotes) where LETTER is one of CI.
"""

#: The providers a judge can be: an OpenAI-compatible chat-completions endpoint.
JUDGE_PROVIDERS = ("openai", "hf")


class JudgeError(Exception):
    """A judge call that gave no reply to grade (unreachable, refused, not a chat answer):
    the task is unscored with this reason, and nothing is cached."""


@dataclass(frozen=True)
class JudgeOptions:
    """The judge as the user gave it: `provider:id` (as --model), its endpoint, a template
    file (None: `DEFAULT_TEMPLATE`), where secrets are read (`.env`) and its key's variable."""

    model: str
    api_base: str | None = None
    template: str | Path | None = None
    env_file: str | Path | None = None
    #: The variable its key is read from (None: its provider's, as --model's).
    key_env: str | None = None

    def spec(self) -> ModelSpec:
        """The judge's model (ConfigError, exit 2: unknown or not a chat-completions one)."""
        try:
            model = parse_model(self.model, api_base=self.api_base, credential_env=self.key_env)
        except ConfigError as exc:
            raise ConfigError(exc.cause.replace("--model", "--judge"), exc.fix) from exc
        if model.provider not in JUDGE_PROVIDERS:
            raise ConfigError(
                f"--judge {self.model!r}: a judge is called on an OpenAI-compatible "
                f"chat-completions endpoint ({', '.join(JUDGE_PROVIDERS)}), not {model.provider}.",
                "Give --judge openai:MODEL (with --judge-api-base for another compatible "
                "server) or hf:MODEL.",
            )
        if model.provider == "hf" and not model.api_base:
            from ..gateway import HF_ROUTER

            model = parse_model(self.model, api_base=HF_ROUTER, credential_env=self.key_env)
        return model

    def read_template(self) -> str:
        """The template's text (ConfigError: unreadable, or without `{answer}`)."""
        if self.template is None:
            return DEFAULT_TEMPLATE
        path = Path(self.template)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(
                f"Cannot read the judge template {path}: {exc}.",
                "Give --judge-template a UTF-8 text file.",
            ) from exc
        if "{answer}" not in text:
            raise ConfigError(
                f"The judge template {path} has no {{answer}} field: the judge would never see "
                "the answer it grades.",
                "Write {question}, {expected} and {answer} where they go, and ask for a reply "
                "ending 'GRADE: C' or 'GRADE: I'.",
            )
        return text

    def check(self) -> None:
        """Every problem before anything starts: the model, the template, the key is set."""
        model = self.spec()
        self.read_template()
        if model.credential_env:
            resolve_secrets([model.credential_env], env_file=self.env_file)

    def fingerprint(self) -> dict[str, Any]:
        """What a resumed batch must judge with too (no key)."""
        template = template_id(self.read_template())
        return {"judge": self.spec().describe(), "judge_template": template}


def template_id(template: str) -> str:
    return hashlib.sha256(template.encode()).hexdigest()[:16]


def render(template: str, *, question: Any, expected: Any, answer: Any) -> str:
    """The prompt: the template with its fields filled in (a list of expected answers is
    shown as any of them)."""
    if isinstance(expected, list):
        expected = " OR ".join(as_text(e) for e in expected)
    values = {"question": question, "expected": expected, "answer": answer}
    for name in FIELDS:
        template = template.replace("{" + name + "}", as_text(values[name]))
    return template


def as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


def parse_grade(text: str) -> str | None:
    """The judge's grade letter (its last `GRADE: X`), or None when it gave none."""
    found = GRADE_PATTERN.findall(text or "")
    return found[-1].upper() if found else None


def grade_key(answer: Any, expected: Any, template: str, judge: str) -> str:
    """What a grade is cached by: the answer, the expected answer, the template, the judge."""
    material = json.dumps([answer, expected, template, judge], default=str, sort_keys=True)
    return hashlib.sha256(material.encode()).hexdigest()


@dataclass(frozen=True)
class JudgeReply:
    """A judge call's reply text and its tokens as the gateway measured them."""

    text: str
    input_tokens: int
    output_tokens: int
    #: The model the request named (what the provider bills the call at).
    model: str | None
    #: The reply said nothing of its usage (the figures are then unknown).
    usage_unknown: bool


class Judge:
    """The judge, ready to be asked: its model, template and key (held here and handed to
    each call's gateway only; never written anywhere)."""

    def __init__(self, options: JudgeOptions) -> None:
        self.model = options.spec()
        self.template = options.read_template()
        self.describe = self.model.describe()
        env = self.model.credential_env
        self._key = resolve_secrets([env], env_file=options.env_file)[env] if env else None
        assert self.model.api_base is not None  # every judge provider has one (`spec`)
        self.upstream = self.model.api_base.rstrip("/")

    def key_for(self, answer: Any, expected: Any) -> str:
        return grade_key(answer, expected, self.template, self.describe)

    def ask(self, prompt: str) -> JudgeReply:
        """One chat-completions call through a gateway of its own (JudgeError: no reply)."""
        body = {
            "model": self.model.model_id,
            "messages": [{"role": "user", "content": prompt}],
            "temperature": 0,
        }
        status, data, events = _run(self._call(json.dumps(body).encode()))
        calls = [e for e in events if e.get("type") == "model_call"]
        call = calls[-1] if calls else {}
        if status != 200:
            detail = _error_text(data) or call.get("error") or f"HTTP {status}"
            raise JudgeError(f"the judge's call failed (HTTP {status}: {detail})")
        try:
            reply = json.loads(data)
            text = reply["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise JudgeError(f"the judge's reply is not a chat completion ({exc!r})") from None
        text = text if isinstance(text, str) else json.dumps(text)
        return JudgeReply(
            text=Masker([self._key] if self._key else [])(text),  # as a run's record is
            input_tokens=int(call.get("input_tokens") or 0),
            output_tokens=int(call.get("output_tokens") or 0),
            model=call.get("model"),
            usage_unknown=bool(call.get("usage_unknown")) or not calls,
        )

    async def _call(self, body: bytes) -> tuple[int, bytes, list[dict[str, Any]]]:
        """The call through a gateway served in this process (ASGI: no port, no network)."""
        import httpx

        from orchestrator_runtime.gateway.__main__ import upstream_client
        from orchestrator_runtime.gateway.app import Gateway, GatewayConfig

        token = random_tokens.token_urlsafe(32)
        config = GatewayConfig.from_json(
            {
                "token": token,
                "key": self._key,
                "upstream": self.upstream,
                "clients": ["127.0.0.1/32"],
                "max_calls": 1,
                "max_tokens": 2**62,
            }
        )
        events: list[dict[str, Any]] = []
        path = urlsplit(config.upstream).path.rstrip("/") + "/chat/completions"
        async with upstream_client() as upstream:
            gateway: Any = Gateway(config, events.append, upstream)  # an ASGI app
            transport = httpx.ASGITransport(app=gateway, client=("127.0.0.1", 1))
            async with httpx.AsyncClient(transport=transport, base_url="http://judge") as client:
                try:
                    response = await client.post(
                        path,
                        content=body,
                        headers={
                            "authorization": f"Bearer {token}",
                            "content-type": "application/json",
                        },
                        timeout=660,
                    )
                except httpx.HTTPError as exc:
                    raise JudgeError(f"the judge's call failed ({type(exc).__name__})") from None
        return response.status_code, response.content, events


def _run(call: Any) -> Any:
    """A coroutine run to its end from a worker thread (each its own event loop)."""
    return asyncio.run(call)


def _error_text(data: bytes) -> str:
    try:
        error = json.loads(data).get("error")
    except (ValueError, AttributeError):
        return ""
    return str(error.get("message") or "") if isinstance(error, dict) else str(error or "")


class GradeCache:
    """`judge.jsonl`: the grades asked for so far, by `grade_key` (thread-safe). Each line
    also carries its call's tokens and cost: the batch counts them in its spend on resume."""

    def __init__(self, folder: str | Path) -> None:
        self.path = Path(folder) / JUDGE_FILE
        self._lock = threading.Lock()
        self.grades = {line["key"]: line for line in read_calls(folder) if "key" in line}

    def get(self, key: str) -> dict[str, Any] | None:
        with self._lock:
            return self.grades.get(key)

    def add(self, line: dict[str, Any]) -> None:
        """Appended whole in one write and fsynced (OSError when it cannot be: the grade is
        still recorded in its result line, only a rescore would ask for it again)."""
        data = (json.dumps(line, default=str) + "\n").encode()
        with self._lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            self.grades[line["key"]] = line


def read_calls(folder: str | Path) -> list[dict[str, Any]]:
    """The lines of a batch folder's `judge.jsonl` (a torn last line skipped)."""
    path = Path(folder) / JUDGE_FILE
    lines = []
    if path.is_file():
        for text in path.read_text(encoding="utf-8").splitlines():
            try:
                line = json.loads(text)
            except ValueError:
                continue
            if isinstance(line, dict):
                lines.append(line)
    return lines


def judge_spent(folder: str | Path, pricing: Pricing | None = None) -> tuple[int, Decimal, int]:
    """What the judge's calls in a batch folder spent: tokens, US dollars (as counted when
    made, else at `pricing` now; 0 without it), and how many calls there were."""
    tokens, cost, calls = 0, Decimal(0), read_calls(folder)
    for call in calls:
        usage = call.get("tokens") or {}
        inp, out = int(usage.get("input") or 0), int(usage.get("output") or 0)
        tokens += inp + out
        if call.get("cost_usd") is not None:
            cost += Decimal(str(call["cost_usd"]))
        elif pricing is not None:
            cost += pricing.cost(inp, out)
    return tokens, cost, len(calls)


def call_line(
    key: str, task_id: str, judge: Judge, reply: JudgeReply, cost: Decimal | None, by: str
) -> dict[str, Any]:
    """A judge call's line in `judge.jsonl` (its grade is added by the caller)."""
    return {
        "key": key,
        "id": task_id,
        "judge": judge.describe,
        "template": template_id(judge.template),
        "text": reply.text,
        "tokens": {"input": reply.input_tokens, "output": reply.output_tokens},
        "usage_unknown": reply.usage_unknown,
        "cost_usd": str(cost) if cost is not None else None,
        "by": by,
        "ts": time.time(),
    }
