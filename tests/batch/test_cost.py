"""The batch's cost cap: `batch --max-cost USD` counts each model call's
gateway-measured tokens at the model's price (`--price`, else genai-prices' bundled prices,
offline); a model with no price, or runs whose tokens the host cannot measure, are refused
before anything starts; at the cap no task starts, running ones are stopped (their own record
says the batch's cap stopped them) and a higher cap resumes."""

from __future__ import annotations

import json
import socket
import threading
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from orchestrator.batch import BatchSpec, plan_batch
from orchestrator.batch.budget import BUDGET_EXCEEDED, Spend, usd
from orchestrator.batch.prices import parse_max_cost, parse_price, pricing_for
from orchestrator.errors import ConfigError
from orchestrator.lifecycle.outcome import Outcome, decide_status
from orchestrator.lifecycle.runner import run
from orchestrator.models import parse_model
from orchestrator.payloads.manifest import load_manifest
from orchestrator.spec import RunError, RunResult, RunSpec, StopRequest
from orchestrator_runtime.gateway.usage import requested_model
from tests.batch.test_session import MATH, math_rows, write_jsonl
from tests.conftest import cli
from tests.model_server import ScriptedModelServer
from tests.test_gateway import model_key  # noqa: F401 - a fixture

docker = pytest.mark.docker
#: A local server: no bundled price applies to it.
LOCAL = "http://127.0.0.1:9/v1"


def attempts(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "attempts.jsonl").open()]


def refused(tmp_path: Path, *args: str) -> str:
    """The batch command with `args`, refused with exit 2 before anything started."""
    tasks = write_jsonl(tmp_path / "tasks.jsonl", math_rows(2))
    out = tmp_path / "out"
    proc = cli("batch", str(MATH), str(tasks), "-o", str(out), *args)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert not out.exists(), proc.stderr
    return proc.stderr


# -- prices given by the user -----------------------------------------------------------------


def test_a_price_is_read_as_model_equals_input_slash_output_per_million_tokens() -> None:
    assert parse_price("openai:gpt-4o-mini=0.15/0.60") == (
        "openai:gpt-4o-mini",
        (Decimal("0.15"), Decimal("0.60")),
    )
    # A model id may hold colons (Ollama's tags); `$` is allowed; 0 is a price (a free server).
    assert parse_price("openai:llama3:8b=$0/0") == ("openai:llama3:8b", (Decimal(0), Decimal(0)))
    assert parse_max_cost("$2.50") == Decimal("2.50") and parse_max_cost(5) == Decimal(5)


@pytest.mark.parametrize(
    "text",
    [
        "openai:gpt-4o-mini",
        "openai:gpt-4o-mini=0.15",
        "=1/2",
        "m=-1/2",
        "m=1/x",
        "m=nan/1",
        "m=1/inf",
    ],
)
def test_a_malformed_price_is_refused_naming_the_format(text: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_price(text)
    assert "MODEL=IN/OUT" in str(caught.value) or "US dollars" in str(caught.value)


@pytest.mark.parametrize("cap", ["0", "-1", "abc", "nan", "inf", "1e999999999"])
def test_a_cost_cap_that_is_no_positive_amount_is_refused_before_anything_starts(
    tmp_path: Path, cap: str
) -> None:
    stderr = refused(tmp_path, "--max-cost", cap)
    assert "--max-cost must be a positive amount in US dollars" in stderr


@pytest.mark.usefixtures("model_key")
def test_a_bad_price_option_is_refused_before_anything_starts(tmp_path: Path) -> None:
    model = ["--model", "openai:scripted", "--api-base", LOCAL]
    stderr = refused(tmp_path, *model, "--max-cost", "1", "--price", "openai:scripted=1")
    assert "MODEL=IN/OUT" in stderr and "--price openai:gpt-4o-mini=0.15/0.60" in stderr
    stderr = refused(tmp_path, *model, "--price", "openai:scripted=1/2")
    assert "--max-cost, which is not set" in stderr
    # A price of another provider's model can price no call of this batch: a typo.
    stderr = refused(tmp_path, *model, "--max-cost", "1", "--price", "litellm:scripted=1/2")
    assert "litellm:scripted, which this batch cannot call" in stderr
    assert "openai:scripted" in stderr


# -- where a price comes from -----------------------------------------------------------------


@pytest.mark.usefixtures("model_key")
def test_a_model_with_no_known_price_is_refused_saying_how_to_give_one(tmp_path: Path) -> None:
    stderr = refused(tmp_path, "--model", "openai:scripted", "--api-base", LOCAL, "--max-cost", "1")
    assert f"--max-cost needs the price of openai:scripted at {LOCAL}" in stderr, stderr
    assert "--price openai:scripted=IN/OUT" in stderr and "nothing was started" in stderr


@pytest.mark.usefixtures("model_key")
def test_runs_whose_tokens_the_host_cannot_measure_are_refused_under_a_cost_cap(
    tmp_path: Path,
) -> None:
    """Fail closed: without the gateway only the sandbox's own claim of its tokens exists."""
    stderr = refused(
        tmp_path,
        "--model",
        "openai:scripted",
        "--api-base",
        LOCAL,
        "--no-gateway",
        "--max-cost",
        "1",
        "--price",
        "openai:scripted=1/2",
    )
    assert "counts only the tokens the model gateway measures" in stderr, stderr
    assert "--max-total-tokens" in stderr  # what to use instead


def test_the_bundled_prices_are_read_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """genai-prices' data ships in the package; a lookup opens no connection."""
    tried: list[Any] = []

    def no_network(self: socket.socket, address: Any) -> None:
        tried.append(address)
        raise OSError("no network in this test")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    pricing = pricing_for(parse_model("openai:gpt-4o-mini"), {})
    assert pricing.source.startswith("genai-prices ") and pricing.model == "openai:gpt-4o-mini"
    assert pricing.input_per_mtok > 0 and pricing.output_per_mtok > pricing.input_per_mtok
    assert pricing.cost(1_000_000, 1_000_000) == pricing.input_per_mtok + pricing.output_per_mtok
    # litellm's provider/model names are found too; the user's price wins over the bundle.
    assert pricing_for(parse_model("litellm:anthropic/claude-sonnet-4-5"), {}).input_per_mtok > 0
    mine = pricing_for(
        parse_model("openai:gpt-4o-mini"), {"openai:gpt-4o-mini": (Decimal(1), Decimal(2))}
    )
    assert mine.source == "--price" and mine.cost(500_000, 250_000) == Decimal("1.0")
    assert tried == []


def test_an_unknown_endpoint_gets_no_bundled_price_even_for_a_known_model_name() -> None:
    """A local server that calls itself gpt-4o-mini bills nothing like OpenAI: ask the user."""
    with pytest.raises(ConfigError, match="--price openai:gpt-4o-mini=IN/OUT"):
        pricing_for(parse_model("openai:gpt-4o-mini", api_base=LOCAL), {})
    with pytest.raises(ConfigError, match="--price hf:"):  # the router picks the provider
        pricing_for(parse_model("hf:Qwen/Qwen2.5-Coder-32B-Instruct"), {})


def test_the_mock_model_costs_nothing(tmp_path: Path) -> None:
    tasks = write_jsonl(tmp_path / "tasks.jsonl", math_rows(1))
    plan = plan_batch(
        BatchSpec(tasks=tasks, output=None, run=RunSpec(payload=MATH), max_cost="0.01")
    )
    assert plan.pricing is not None and plan.pricing.source.startswith("mock")
    assert plan.pricing.cost(10**9, 10**9) == 0


# -- counting ---------------------------------------------------------------------------------


def spend_of(
    tmp_path: Path, *, other: dict[str, Any] | None = None, **caps: Any
) -> tuple[Spend, StopRequest, list[str]]:
    """A batch's Spend over a plan of OpenAI's gpt-4o-mini, priced by the user at $1/$2 per
    million tokens (calls fed by hand, as the gateway's events come)."""
    tasks = write_jsonl(tmp_path / "tasks.jsonl", math_rows(2))
    run_spec = RunSpec(payload=MATH, model="openai:gpt-4o-mini")
    spec = BatchSpec(
        tasks=tasks,
        output=tmp_path / "out",
        run=run_spec,
        prices={"openai:gpt-4o-mini": ("1", "2"), **(other or {})},
        **caps,
    )
    plan = plan_batch(spec)
    stop, reasons = StopRequest(), []
    spend = Spend(spec, plan, [], stop=stop, on_reached=reasons.append, message=lambda _m: None)
    return spend, stop, reasons


def call(spend: Spend, run_id: str, inp: int, out: int, **extra: Any) -> None:
    spend.watch(run_id)(
        {
            "type": "model_call",
            "source": "gateway",
            "input_tokens": inp,
            "output_tokens": out,
            **extra,
        }
    )


@pytest.mark.usefixtures("model_key")
def test_each_measured_call_costs_its_tokens_and_the_call_that_reaches_the_cap_stops_all(
    tmp_path: Path,
) -> None:
    spend, stop, reasons = spend_of(tmp_path, max_cost="0.01")
    call(spend, "r-1", 4000, 1000)  # $0.004 + $0.002
    spend.watch("r-1")({"type": "model_call", "source": "sandbox", "input_tokens": 10**9})
    assert spend.cost == Decimal("0.006") and not stop.is_set()  # the sandbox's claim: ignored
    call(spend, "r-2", 2000, 1000)  # $0.004 more: $0.010 reaches $0.01
    assert stop.is_set() and reasons == [BUDGET_EXCEEDED]
    assert stop.error is not None and stop.error.type == BUDGET_EXCEEDED
    assert "--max-cost $0.01 was reached ($0.01 spent" in stop.error.message
    assert spend.progress()["spent_cost"] == pytest.approx(0.01)
    # A run the cap stopped: its line says budget_exceeded with its own cost.
    stopped = RunResult(run_id="r-2", status="cancelled", error=stop.error)
    line = spend.ended("r-2", stopped)
    assert line["status"] == BUDGET_EXCEEDED and line["error"] == stop.error.to_dict()
    assert Decimal(line["cost_usd"]) == Decimal("0.004") and line["uncounted_calls"] == 0
    assert reasons == [BUDGET_EXCEEDED]  # said once


@pytest.mark.usefixtures("model_key")
def test_a_call_the_gateway_could_not_measure_stops_a_cost_capped_batch(tmp_path: Path) -> None:
    """Fail closed: its spend is unknown, so the cap can no longer be kept."""
    spend, stop, _ = spend_of(tmp_path, max_cost="100")
    spend.watch("r-1")({"type": "model_call", "source": "gateway", "usage_unknown": True})
    assert stop.is_set() and stop.error is not None
    assert "could not be measured" in stop.error.message
    assert spend.ended("r-1", RunResult(run_id="r-1", status="succeeded"))["uncounted_calls"] == 1


@pytest.mark.usefixtures("model_key")
def test_a_call_is_priced_by_the_model_its_request_names(tmp_path: Path) -> None:
    """The provider bills the model the request names, whatever the run was given: another
    known model costs its own (bundled) price; one with no known price stops the batch."""
    spend, stop, _ = spend_of(tmp_path, max_cost="100", other={"openai:my-tune": (5, 5)})
    call(spend, "r-1", 1_000_000, 0, model="my-tune")  # priced by the user too: $5
    call(spend, "r-1", 1_000_000, 0, model="gpt-4o-mini")  # the batch's: the user's $1
    assert spend.cost == Decimal(6)
    bundled = pricing_for(parse_model("openai:gpt-4o"), {})
    call(spend, "r-1", 1_000_000, 0, model="gpt-4o")  # another: its list price, not $1
    assert spend.cost == 6 + bundled.input_per_mtok and bundled.input_per_mtok > 1
    assert not stop.is_set()
    call(spend, "r-1", 10, 10, model="made-up-model-9000")
    assert stop.is_set() and stop.error is not None
    message = stop.error.message
    assert "named the model 'made-up-model-9000', whose price is not known" in message
    assert "--price openai:made-up-model-9000=IN/OUT" in message and "fail closed" in message
    assert (
        spend.ended("r-1", RunResult(run_id="r-1", status="cancelled", error=stop.error))[
            "uncounted_calls"
        ]
        == 1
    )


def test_the_gateway_reads_the_model_a_request_names() -> None:
    assert requested_model(b'{"model": "gpt-4o-mini", "messages": []}') == "gpt-4o-mini"
    assert requested_model(json.dumps({"model": "m" * 500}).encode()) == "m" * 200
    for body in (b"", b"not json", b'["model"]', b'{"model": 7}', b'{"messages": []}'):
        assert requested_model(body) is None


@pytest.mark.usefixtures("model_key")
def test_either_cap_stops_the_batch_whichever_comes_first(tmp_path: Path) -> None:
    spend, stop, _ = spend_of(tmp_path, max_cost="100", max_total_tokens=50)
    call(spend, "r-1", 40, 10)
    assert stop.error is not None and "--max-total-tokens 50 was reached" in stop.error.message


def test_a_run_stopped_for_a_reason_records_that_reason_not_a_user_cancel() -> None:
    """Item 2's fix, where the run's status is decided (`outcome.decide_status`)."""
    from orchestrator.backends.base import ExitInfo

    stop = StopRequest()
    stop.stop(RunError(BUDGET_EXCEEDED, "the batch's cap ... was reached"))
    stop.stop(RunError("other", "a later reason"))  # the first one stays
    cancelled = Outcome("cancelled")
    status, error = decide_status(cancelled, ExitInfo(exit_code=137), None, cancel=stop)
    assert status == "cancelled" and error is not None
    assert error.to_dict() == {
        "type": BUDGET_EXCEEDED,
        "message": "the batch's cap ... was reached",
    }
    plain = threading.Event()
    plain.set()
    _, error = decide_status(cancelled, ExitInfo(exit_code=137), None, cancel=plain)
    assert error is not None
    assert error.to_dict() == {"type": "cancelled", "message": "cancelled by the user"}


@docker
def test_a_run_stopped_before_its_sandbox_existed_records_the_reason_too() -> None:
    stop = StopRequest()
    stop.stop(RunError(BUDGET_EXCEEDED, "the batch's cap was reached"))
    result = run(RunSpec(payload=MATH, task="1+1"), cancel=stop)
    assert result.status == "cancelled" and result.error == stop.error
    record = json.loads((Path(result.record_dir or "") / "result.json").read_text())
    assert record["error"] == {"type": BUDGET_EXCEEDED, "message": "the batch's cap was reached"}


def test_amounts_are_shown_to_the_cent_or_finer() -> None:
    assert [usd(Decimal(5)), usd(0.000123), usd(Decimal("0.0012345678"))] == [
        "$5.00",
        "$0.000123",
        "$0.001235",
    ]


# -- end to end -------------------------------------------------------------------------------


@docker
@pytest.mark.usefixtures("model_key", "nothing_left")
def test_a_batch_stops_at_its_cost_cap_and_a_higher_cap_resumes_it(
    agent_image: str, tmp_path: Path
) -> None:
    """Through the command, the gateway measuring every call; the user's price of $1000 per
    million tokens each way makes every token cost a tenth of a cent."""
    step = load_manifest(MATH).mock_scripts["manager"][0]
    tasks = write_jsonl(tmp_path / "tasks.jsonl", math_rows(3))
    out = tmp_path / "out"

    with ScriptedModelServer([step] * 10) as server:

        def batch(cap: str) -> tuple[int, dict, str]:
            proc = cli(
                "batch",
                str(MATH),
                str(tasks),
                "-o",
                str(out),
                "-j",
                "1",
                "--no-warm",
                "--model",
                "openai:scripted",
                "--api-base",
                server.api_base(),
                "--max-cost",
                cap,
                "--price",
                "openai:scripted=1000/1000",
                "--json",
            )
            return proc.returncode, json.loads(proc.stdout), proc.stderr

        # $0.01 is 10 tokens: the first task's first call reaches it.
        code, summary, stderr = batch("0.01")
        spend = summary["spend"]
        assert code == 5 and summary["stop_reason"] == "budget_exceeded", stderr
        assert spend["stopped_by"] == "max_cost" and spend["cap_reached"], spend
        assert spend["cost_usd"] == pytest.approx(sum(server.usage.values()) / 1000)
        assert spend["price"] == {
            "model": "openai:scripted",
            "source": "--price",
            "input_per_mtok": 1000.0,
            "output_per_mtok": 1000.0,
        }
        assert "--max-cost $0.01 was reached" in stderr and "higher --max-cost" in stderr
        assert len([a for a in attempts(out) if a["event"] == "start"]) == 1
        (first,) = [a for a in attempts(out) if a["event"] == "end"]
        assert Decimal(first["cost_usd"]) * 1000 == sum(server.usage.values())
        # Each call was priced by the model its request named, as the gateway read it.
        events = (Path(first["record_dir"]) / "events.jsonl").read_text().splitlines()
        calls = [e for e in map(json.loads, events) if e["type"] == "model_call"]
        assert calls and {c.get("model") for c in calls} == {"scripted"}, calls
        if first["status"] == "budget_exceeded":  # unless it ended before the host saw the call
            record = json.loads((Path(first["record_dir"]) / "result.json").read_text())
            assert record["status"] == "cancelled", record
            assert record["error"]["type"] == "budget_exceeded"
            assert "--max-cost $0.01 was reached" in record["error"]["message"]

        # High enough: the rest runs, and the first session's cost still counts.
        code, summary, stderr = batch("1000")
        served = sum(server.usage.values())
    assert code == 0, stderr
    assert summary["state"] == "complete" and summary["counts"]["succeeded"] == 3, summary
    assert summary["spend"]["cost_usd"] == pytest.approx(served / 1000)
    assert summary["spend"]["stopped_by"] is None and not summary["spend"]["cap_reached"]
