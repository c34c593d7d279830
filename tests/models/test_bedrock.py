"""Amazon Bedrock with no AWS secret in the sandbox.

The sandbox's Bedrock client signs with AWS credentials of the run's own (random, made on
the host for this run) and is pointed at the run's gateway; the gateway checks that
signature with botocore, signs the request again with the host's credentials and forwards it
to Bedrock (here a scripted Bedrock server that checks the host's signature in turn,
tests/bedrock_server.py), measuring converse's and converse-stream's tokens on the way.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import secrets
import socket
import string
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from botocore.eventstream import EventStreamBuffer
from botocore.exceptions import ClientError

from orchestrator import RunSpec
from orchestrator.errors import ConfigError
from orchestrator.gateway import sandbox_secrets
from orchestrator.lifecycle.runner import build_request, prepare
from orchestrator_runtime.gateway.app import Gateway, GatewayConfig
from orchestrator_runtime.gateway.usage import UsageReader, requested_model
from tests.bedrock_server import BedrockServer, event_frame
from tests.conftest import REPO, cli
from tests.models.test_model_routes import HASHING_PRELUDE

MODEL = "anthropic.claude-3-haiku-20240307-v1:0"
REGION = "us-east-1"
CONVERSE = f"/model/{MODEL.replace(':', '%3A')}/converse"
ANSWER = "Thought: I answer.\n<code>\nfinal_answer('from bedrock')\n</code>"


def aws_keys(token: bool = False) -> Credentials:
    """Random AWS-shaped credentials (a key id of 20 capitals and digits, a 40-character
    secret), with a session token when asked."""
    alphabet = string.ascii_uppercase + string.digits
    key_id = "AKIA" + "".join(secrets.choice(alphabet) for _ in range(16))
    return Credentials(
        key_id, secrets.token_urlsafe(30), secrets.token_urlsafe(40) if token else None
    )


def signing_config(run: Credentials, host: Credentials) -> dict[str, Any]:
    """The gateway's configuration's signing part, and its key (the host's credentials)."""
    return {
        "signing": {
            "kind": "aws-sigv4",
            "region": REGION,
            "service": "bedrock",
            "access_key_id": run.access_key,
            "secret_access_key": run.secret_key,
        },
        "key": json.dumps(
            {
                "access_key_id": host.access_key,
                "secret_access_key": host.secret_key,
                "session_token": host.token,
            }
        ),
    }


def signed(keys: Credentials, url: str, body: bytes, *, region: str = REGION) -> dict[str, str]:
    """The headers botocore's SigV4 puts on a POST of `body` to `url`."""
    request = AWSRequest(
        method="POST", url=url, data=body, headers={"Content-Type": "application/json"}
    )
    SigV4Auth(keys, "bedrock", region).add_auth(request)
    return dict(request.headers.items())


@pytest.fixture
def host_keys(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Credentials:
    """This host's AWS settings, for botocore: these credentials (with a session token) in
    the environment, no region, no files, no instance role."""
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    keys = aws_keys(token=True)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", keys.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", keys.secret_key)
    monkeypatch.setenv("AWS_SESSION_TOKEN", str(keys.token))
    return keys


def bedrock_program(folder: Path, client_kwargs: str = '{"region_name": "us-east-1"}') -> Path:
    """A program whose agent's model is Bedrock's, as smolagents' docs write it."""
    path = folder / "bedrock_program.py"
    path.write_text(
        "from smolagents import AmazonBedrockModel, CodeAgent\n"
        f"model = AmazonBedrockModel(model_id={MODEL!r}, client_kwargs={client_kwargs})\n"
        "agent = CodeAgent(tools=[], model=model)\n"
        'print("answer:", agent.run("Say hi."))\n'
    )
    return path


# ---- the host: what a Bedrock run's sandbox and gateway get -----------------------------------


def test_the_sandbox_gets_the_runs_own_aws_credentials_and_the_gateway_the_hosts(
    tmp_path: Path, host_keys: Credentials
) -> None:
    prepared = prepare(RunSpec(payload=bedrock_program(tmp_path)))
    model, gateway = prepared.model, prepared.gateway
    assert (model.provider, model.model_id, model.aws_region) == ("bedrock", MODEL, REGION)
    assert gateway is not None and gateway.aws is not None and gateway.aws.region == REGION
    assert gateway.upstream == "https://bedrock-runtime.us-east-1.amazonaws.com"
    assert gateway.describe()["protocol"] == f"POST /model/{MODEL}/converse"
    assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} & set(prepared.secrets_inside)
    # Inside: the run's own credentials, no session token, nothing of the host's.
    inside, key = sandbox_secrets(prepared.secrets, gateway)
    assert inside["AWS_ACCESS_KEY_ID"] == gateway.aws.access_key_id != host_keys.access_key
    assert inside["AWS_SECRET_ACCESS_KEY"] == gateway.aws.secret_access_key
    assert "AWS_SESSION_TOKEN" not in inside
    for value in (host_keys.access_key, host_keys.secret_key, str(host_keys.token)):
        assert all(value not in v for v in inside.values())
    # The client inside finds the gateway and the region; the request holds no secret.
    request = build_request(prepared, api_base="http://gateway.test:8000")
    assert request.endpoint_env == ["AWS_ENDPOINT_URL_BEDROCK_RUNTIME"]
    assert request.model_env == {
        "AWS_REGION": REGION,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_EC2_METADATA_DISABLED": "true",  # no instance role inside to look for
    }
    assert request.credential_env == "AWS_SECRET_ACCESS_KEY"
    assert host_keys.secret_key not in request.to_json()
    # The gateway gets the host's on its stdin, and the run's to check signatures against.
    config = GatewayConfig.from_json(gateway.stdin_config(key, ["10.0.0.0/8"], 8000))
    assert config.signing is not None and config.key is None
    assert config.signing.host.secret_access_key == host_keys.secret_key
    assert config.signing.host.session_token == host_keys.token
    assert config.signing.run.access_key_id == gateway.aws.access_key_id
    assert host_keys.secret_key not in json.dumps(gateway.describe())


def test_the_region_and_endpoint_come_from_the_program_else_the_host(
    tmp_path: Path, host_keys: Credentials, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The program's literal region; else AWS_REGION (or botocore's own settings) on the
    host; the endpoint botocore resolves for it, or the user's endpoint setting."""
    no_region = bedrock_program(tmp_path, client_kwargs="{}")
    with pytest.raises(ConfigError) as missing:
        prepare(RunSpec(payload=no_region))
    assert "AWS_REGION" in missing.value.fix and "region_name" in missing.value.fix
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    assert prepare(RunSpec(payload=no_region)).model.api_base == (
        "https://bedrock-runtime.eu-west-1.amazonaws.com"
    )
    monkeypatch.setenv("AWS_REGION", "ap-northeast-1")
    assert prepare(RunSpec(payload=no_region)).model.aws_region == "ap-northeast-1"
    assert prepare(RunSpec(payload=bedrock_program(tmp_path))).model.aws_region == REGION
    monkeypatch.setenv("AWS_ENDPOINT_URL_BEDROCK_RUNTIME", "http://127.0.0.1:9")
    prepared = prepare(RunSpec(payload=no_region))
    assert prepared.model.api_base == "http://127.0.0.1:9"
    assert prepared.gateway is not None and prepared.gateway.on_this_host  # reached from it
    # The run's own model as well: --model bedrock:ID.
    chosen = prepare(RunSpec(payload=no_region, model="bedrock:amazon.nova-pro-v1:0"))
    assert (chosen.model.model_id, chosen.model_source) == ("amazon.nova-pro-v1:0", "run")
    assert chosen.gateway is not None and chosen.gateway.aws is not None


def test_no_aws_credentials_two_regions_or_no_gateway_start_nothing(
    tmp_path: Path, host_keys: Credentials, monkeypatch: pytest.MonkeyPatch
) -> None:
    program = bedrock_program(tmp_path)
    with pytest.raises(ConfigError, match="--no-gateway"):
        prepare(RunSpec(payload=program, gateway=False))
    two = tmp_path / "two.py"
    two.write_text(
        program.read_text()
        + f"other = AmazonBedrockModel({MODEL!r}, client_kwargs={{'region_name': 'eu-west-1'}})\n"
    )
    with pytest.raises(ConfigError, match="more than one endpoint"):
        prepare(RunSpec(payload=two))
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name)
    with pytest.raises(ConfigError) as missing:
        prepare(RunSpec(payload=program))
    assert "AWS credentials" in str(missing.value) and "AWS_PROFILE" in missing.value.fix


def test_a_check_or_another_model_still_makes_the_programs_bedrock_model(
    tmp_path: Path, host_keys: Credentials, monkeypatch: pytest.MonkeyPatch
) -> None:
    """boto3 makes no client without a region: when the run does not use the program's
    Bedrock model (`validate`, or --model in its place), the sandbox still gets one (the
    program's, the host's, else a fixed one), so the program runs as far as its agents;
    and botocore looks for no instance role there (no metadata endpoint to wait for)."""
    from tests.runtime.test_runtime import run_runtime

    no_region = bedrock_program(tmp_path, client_kwargs="{}")
    replaced = prepare(RunSpec(payload=no_region, model="mock"))
    assert build_request(replaced).model_env == {
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    assert replaced.gateway is None and host_keys.secret_key not in str(replaced.secrets)
    monkeypatch.setenv("AWS_REGION", "eu-west-1")  # the host's, not the program's
    checked = prepare(RunSpec(payload=no_region, check_only=True))
    request = replace(build_request(checked), secrets=dict(checked.secrets))
    assert request.model_env["AWS_REGION"] == "eu-west-1"
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)  # the runtime's process has only what it is given
    outcome = run_runtime(request.to_wire(), fresh=True)
    assert outcome.returncode == 0, outcome.stderr[-3000:]
    (start,) = outcome.of_type("run_start")  # the tree was built: the model was made
    assert start["agents"][0]["model"]["class"] == "AmazonBedrockModel"
    assert not outcome.of_type("step") and not outcome.of_type("egress_blocked")


# ---- what the gateway reads of Bedrock's answers ---------------------------------------------


def test_event_frames_are_botocores_and_converse_usage_is_read_split_anywhere() -> None:
    frames = [
        event_frame("messageStart", {"role": "assistant"}),
        event_frame("contentBlockDelta", {"contentBlockIndex": 0, "delta": {"text": "hi"}}),
        event_frame("metadata", {"usage": {"inputTokens": 31, "outputTokens": 4}}),
    ]
    parser = EventStreamBuffer()
    parser.add_data(b"".join(frames))
    parsed = list(parser)
    assert [m.headers[":event-type"] for m in parsed] == [
        "messageStart",
        "contentBlockDelta",
        "metadata",
    ]
    assert json.loads(parsed[1].payload)["delta"]["text"] == "hi"

    stream = b"".join(frames)
    reader = UsageReader("application/vnd.amazon.eventstream")
    for i in range(0, len(stream), 7):
        reader.feed(stream[i : i + 7])
    reader.close()
    assert (reader.input_tokens, reader.output_tokens, reader.streamed) == (31, 4, True)

    broken = UsageReader("application/vnd.amazon.eventstream")
    broken.feed(frames[0][:-1] + b"\x00" + frames[2])  # a bad checksum: read no further
    broken.close()
    assert (broken.input_tokens, broken.output_tokens) == (None, None)

    reader = UsageReader("application/json")
    reader.feed(json.dumps({"usage": {"inputTokens": 12, "outputTokens": 3}}).encode())
    reader.close()
    assert (reader.input_tokens, reader.output_tokens) == (12, 3)
    assert requested_model(b"{}", f"/model/{MODEL}/converse-stream") == MODEL
    arn = "arn:aws:bedrock:us-east-1:123456789012:inference-profile/us.anthropic.claude"
    assert requested_model(b"{}", f"/model/{arn}/converse") == arn


# ---- the gateway's check of the sandbox's signature, in process -------------------------------


def test_a_forged_signature_is_refused_and_nothing_is_forwarded() -> None:
    """Only a request signed with the run's credentials, for its region, now, over the body
    it carries, goes on: a wrong secret, another key id, a tampered body, another region,
    a body whose declared hash is not its own, a bearer token or no signature are 401."""
    run, host, other = aws_keys(), aws_keys(), aws_keys()
    body = json.dumps({"messages": [{"role": "user", "content": [{"text": "hi"}]}]}).encode()
    base = "http://gateway.test"
    good = signed(run, base + CONVERSE, body)
    forged_headers = {
        "wrong secret": signed(
            Credentials(run.access_key, other.secret_key), base + CONVERSE, body
        ),
        "other key id": signed(other, base + CONVERSE, body),
        "other region": signed(run, base + CONVERSE, body, region="eu-west-1"),
        "tampered body": good,
        "declared hash": {**good, "X-Amz-Content-SHA256": hashlib.sha256(b"{}").hexdigest()},
        "bearer token": {"Authorization": f"Bearer {run.secret_key}"},
        "none": {},
    }
    events: list[dict[str, Any]] = []
    with BedrockServer([ANSWER], keys=host) as server:
        config = GatewayConfig.from_json(
            {
                "token": secrets.token_urlsafe(32),
                "upstream": server.base(),
                "clients": ["127.0.0.0/8"],
                "max_calls": 10,
                "max_tokens": 10**6,
                **signing_config(run, host),
            }
        )

        async def send_all() -> dict[str, httpx.Response]:
            upstream = httpx.AsyncClient()
            app = Gateway(config, events.append, upstream)
            transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 40000))
            answers = {}
            async with upstream, httpx.AsyncClient(transport=transport, base_url=base) as client:
                for case, headers in forged_headers.items():
                    content = body + b" " if case == "tampered body" else body
                    answers[case] = await client.post(CONVERSE, content=content, headers=headers)
                answers["good"] = await client.post(CONVERSE, content=body, headers=good)
            return answers

        answers = asyncio.run(send_all())
    for case in forged_headers:
        assert answers[case].status_code == 401, case
        assert answers[case].headers["x-amzn-errortype"] == "bad_signature"
    assert answers["good"].status_code == 200, answers["good"].text
    assert answers["good"].json()["output"]["message"]["content"][0]["text"] == ANSWER
    # Only the good call reached Bedrock, signed by the host and by nobody else.
    assert len(server.requests) == 1 and not server.refused
    authorization = server.requests[0]["headers"]["authorization"]
    assert f"Credential={host.access_key}/" in authorization and run.access_key not in authorization
    refused = [e for e in events if e["type"] == "model_call_refused"]
    assert len(refused) == len(forged_headers) and {e["reason"] for e in refused} == {
        "bad_signature"
    }
    (call,) = [e for e in events if e["type"] == "model_call"]
    assert call["model"] == MODEL
    assert (call["input_tokens"], call["output_tokens"]) == tuple(server.usage.values())


def test_a_signature_from_another_time_is_refused() -> None:
    """The date signed is checked against the gateway's clock (AWS's 15 minutes either way):
    a request recorded now does not pass later."""
    from orchestrator_runtime.gateway.sigv4 import Signing

    run, host = aws_keys(), aws_keys()
    parts = signing_config(run, host)
    signing = Signing.from_json(parts["signing"], parts["key"])
    body = b'{"messages": []}'
    url = "http://gateway.test" + CONVERSE
    headers = [(k.lower().encode(), v.encode()) for k, v in signed(run, url, body).items()]
    headers.append((b"host", b"gateway.test"))
    now = time.time()
    assert signing.check("POST", CONVERSE, "", headers, body, now) is None
    later = signing.check("POST", CONVERSE, "", headers, body, now + 16 * 60)
    assert later == "the signature's date is not now"


# ---- the real gateway process, and a real boto3 client ----------------------------------------


class SigningGateway:
    """The real gateway (`python -m orchestrator_runtime.gateway`) on a free port of this
    host, given `config` (its port added) on its stdin as a backend gives it."""

    def __init__(self, config: dict[str, Any]) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.events: list[dict[str, Any]] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator_runtime.gateway"],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps({**config, "port": self.port}) + "\n")
        self.proc.stdin.flush()
        assert json.loads(self.proc.stdout.readline())["type"] == "gateway_ready"
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.url = f"http://127.0.0.1:{self.port}"

    def _read(self) -> None:
        assert self.proc.stdout
        for line in self.proc.stdout:
            self.events.append(json.loads(line))

    def stop(self) -> int:
        assert self.proc.stdin
        self.proc.stdin.write("stop\n")
        self.proc.stdin.flush()
        code = self.proc.wait(timeout=10)
        self.reader.join(timeout=5)
        return code


def test_a_boto3_client_with_the_runs_credentials_converses_through_the_gateway() -> None:
    """boto3's own bedrock-runtime client, signing with the run's credentials, gets its
    converse and converse-stream answers through the gateway; Bedrock sees only the host's
    signature and session token; the gateway measures both calls' tokens as Bedrock
    counted them; the streamed answer comes whole through botocore's own parser."""
    import boto3

    run, host = aws_keys(), aws_keys(token=True)
    with BedrockServer([ANSWER, "streamed " * 20], keys=host) as server:
        gateway = SigningGateway(
            {
                "token": secrets.token_urlsafe(32),
                "upstream": server.base(),
                "clients": ["127.0.0.0/8"],
                "max_calls": 10,
                "max_tokens": 10**6,
                **signing_config(run, host),
            }
        )
        try:
            client = boto3.client(
                "bedrock-runtime",
                region_name=REGION,
                endpoint_url=gateway.url,
                aws_access_key_id=run.access_key,
                aws_secret_access_key=run.secret_key,
            )
            messages = [{"role": "user", "content": [{"text": "hi"}]}]
            answer = client.converse(modelId=MODEL, messages=messages)
            assert answer["output"]["message"]["content"][0]["text"] == ANSWER
            assert answer["usage"]["inputTokens"] > 0
            stream = client.converse_stream(modelId=MODEL, messages=messages)["stream"]
            events = list(stream)
            text = "".join(
                e["contentBlockDelta"]["delta"]["text"] for e in events if "contentBlockDelta" in e
            )
            assert text == "streamed " * 20
            assert events[-1]["metadata"]["usage"]["outputTokens"] > 0
            # Bedrock itself (the server) refuses the run's credentials: only the host's pass.
            direct = boto3.client(
                "bedrock-runtime",
                region_name=REGION,
                endpoint_url=server.base(),
                aws_access_key_id=run.access_key,
                aws_secret_access_key=run.secret_key,
            )
            with pytest.raises(ClientError) as refused:
                direct.converse(modelId=MODEL, messages=messages)
            assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
        finally:
            assert gateway.stop() == 0
    assert len(server.refused) == 1 and run.access_key in server.refused[0]
    server.requests = [r for r in server.requests if run.access_key not in str(r["headers"])]
    assert len(server.requests) == 2
    for request in server.requests:
        assert request["headers"]["x-amz-security-token"] == host.token
        assert run.access_key not in request["headers"]["authorization"]
    calls = [e for e in gateway.events if e["type"] == "model_call"]
    assert [c["streamed"] for c in calls] == [False, True]
    measured = {
        "input_tokens": sum(c["input_tokens"] for c in calls),
        "output_tokens": sum(c["output_tokens"] for c in calls),
    }
    assert measured == server.usage
    assert gateway.events[-1]["type"] == "gateway_closed"


@pytest.mark.parametrize("chosen_by", ["program", "run"])
def test_a_bedrock_model_answers_through_the_gateway_from_the_runtime(
    tmp_path: Path, host_keys: Credentials, monkeypatch: pytest.MonkeyPatch, chosen_by: str
) -> None:
    """The host's plan, the real gateway and the real runtime (no container): the program's
    AmazonBedrockModel as written, or the run's (`--model bedrock:ID`, in its place), signs
    with the run's credentials for the run's region and reaches Bedrock through the gateway;
    smolagents reads the answer (the runtime gives it the `tool_calls` it expects of
    Bedrock's answer)."""
    from tests.runtime.test_runtime import run_runtime

    chosen = f"bedrock:{MODEL}" if chosen_by == "run" else None
    with BedrockServer([ANSWER], keys=host_keys) as server:
        monkeypatch.setenv("AWS_ENDPOINT_URL_BEDROCK_RUNTIME", server.base())
        monkeypatch.setenv("AWS_REGION", REGION)  # the run's model has no region_name
        prepared = prepare(RunSpec(payload=bedrock_program(tmp_path), model=chosen))
        assert prepared.gateway is not None and prepared.model_source == chosen_by
        inside, key = sandbox_secrets(prepared.secrets, prepared.gateway)
        config = prepared.gateway.stdin_config(key, ["127.0.0.0/8"], 1)
        gateway = SigningGateway({**config, "upstream": server.base()})  # HOST_ALIAS: Docker's
        try:
            request = replace(build_request(prepared, api_base=gateway.url), secrets=inside)
            for name in [n for n in os.environ if n.startswith("AWS_")]:
                monkeypatch.delenv(name)  # the runtime's process has only what it is given
            outcome = run_runtime(request.to_wire(), fresh=True)
        finally:
            assert gateway.stop() == 0
    assert outcome.returncode == 0, outcome.stderr[-3000:]
    assert outcome.end["state"] == "success" and outcome.end["answer"] == "from bedrock"
    (start,) = outcome.of_type("run_start")
    model = start["agents"][0]["model"]
    assert (model["class"], model["model_id"]) == ("AmazonBedrockModel", MODEL)
    assert model.get("routed_to") == ("gateway" if chosen_by == "program" else None)
    assert len(server.requests) == 1 and not server.refused
    (call,) = [e for e in gateway.events if e["type"] == "model_call"]
    assert {"input_tokens": call["input_tokens"], "output_tokens": call["output_tokens"]} == (
        server.usage
    )


# ---- the whole path on the real engine ----------------------------------------------------------

#: After the agent's run (converse, through smolagents), the model's own client streams
#: (converse-stream): smolagents' AmazonBedrockModel has no streaming of its own.
STREAMING_EPILOGUE = """
stream = model.client.converse_stream(
    modelId=model.model_id, messages=[{"role": "user", "content": [{"text": "Stream."}]}]
)["stream"]
text = "".join(e["contentBlockDelta"]["delta"]["text"] for e in stream if "contentBlockDelta" in e)
print("streamed:", text)
"""


def run_bedrock_program(folder: Path, *args: str, host_address: str = "127.0.0.1") -> None:
    """The program as smolagents' docs write it, the host's AWS credentials (a session token
    too) in its environment and Bedrock at the user's endpoint setting (reached at
    `host_address`), run with `args`: the agent's converse and the client's converse-stream
    reach Bedrock signed by the host only, the record has the gateway's tokens (Bedrock's own
    figures), and a program hashing every environment value and file under /tmp and $HOME
    in its sandbox finds none of the host's credentials."""
    host = aws_keys(token=True)
    program = folder / "bedrock_agent.py"
    program.write_text(HASHING_PRELUDE + bedrock_program(folder).read_text() + STREAMING_EPILOGUE)
    with BedrockServer([ANSWER, "a streamed answer " * 5], keys=host) as server:
        env = {
            "AWS_ACCESS_KEY_ID": host.access_key,
            "AWS_SECRET_ACCESS_KEY": host.secret_key,
            "AWS_SESSION_TOKEN": str(host.token),
            "AWS_ENDPOINT_URL_BEDROCK_RUNTIME": server.base(host_address),  # the user's own
            "AWS_SHARED_CREDENTIALS_FILE": str(folder / "no-credentials"),
            "AWS_CONFIG_FILE": str(folder / "no-config"),
            "AWS_EC2_METADATA_DISABLED": "true",
        }
        done = cli("run", "--json", "--timeout", "300", *args, str(program), env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    outcome = json.loads(done.stdout)
    assert outcome["status"] == "succeeded" and outcome["answer"] == "from bedrock"
    record = Path(outcome["record_dir"])
    logs = (record / "stderr.log").read_text()
    assert "streamed: " + "a streamed answer " * 5 in logs
    # Bedrock saw both calls signed by the host (it refuses any other signature).
    assert not server.refused and len(server.requests) == 2
    assert [r["path"].rsplit("/", 1)[-1] for r in server.requests] == [
        "converse",
        "converse-stream",
    ]
    for request in server.requests:
        assert f"Credential={host.access_key}/" in request["headers"]["authorization"]
        assert request["headers"]["x-amz-security-token"] == host.token
    # The gateway's measured tokens are Bedrock's own figures, for both calls.
    assert outcome["token_usage_source"] == "gateway"
    assert {k: outcome["token_usage"][k] for k in server.usage} == server.usage
    assert outcome["gateway"]["signing"] == f"AWS SigV4, {REGION}"
    events = [json.loads(line) for line in (record / "events.jsonl").read_text().splitlines()]
    calls = [e for e in events if e["type"] == "model_call" and e.get("source") == "gateway"]
    assert [c["streamed"] for c in calls] == [False, True] and calls[0]["model"] == MODEL
    start = next(e for e in events if e["type"] == "run_start")
    assert start["agents"][0]["model"]["routed_to"] == "gateway"
    # Nothing of the host's credentials anywhere inside; the prelude did look (the region).
    hashes = {line.split()[1] for line in logs.splitlines() if line.startswith("sha256 ")}
    assert hashlib.sha256(REGION.encode()).hexdigest() in hashes and len(hashes) > 5
    for value in (host.secret_key, str(host.token), host.access_key):
        assert hashlib.sha256(value.encode()).hexdigest() not in hashes
        assert value not in done.stdout + done.stderr


@pytest.mark.docker
def test_a_bedrock_program_runs_through_the_gateway_with_no_aws_secret_inside(
    tmp_path: Path,
) -> None:
    run_bedrock_program(tmp_path)
