"""What a batch's model calls cost, for `batch --max-cost USD`: the price of the batch's model,
checked before anything starts.

Where a price comes from, first match wins:

1. the user: `--price MODEL=IN/OUT` (US dollars per million input and output tokens, `MODEL`
   as `--model` spells it: `openai:gpt-4o-mini=0.15/0.60`; `BatchSpec.prices` in Python);
2. `mock`: costs nothing (no model is called, nothing is billed);
3. the prices bundled with `genai-prices` (pydantic's price data, MIT, offline: we never
   start its opt-in updater, so a lookup reads the installed package and nothing else), for a
   model served where the price is the provider's list price: `openai` and `litellm` at
   their provider's endpoint (`api_base` matched against genai-prices' provider URLs, so
   OpenAI, Groq, OpenRouter, Together... are found; a local server is not). Newer prices
   come with `pip install -U genai-prices`; the summary names the version used.

Anything else (a local or unknown server, `hf`, whose router picks the provider per call, a
model genai-prices does not know) has no price: `--max-cost` is refused before anything
starts (exit 2), saying how to give one. Nothing is ever counted as free by default.

Why genai-prices: it is kept by pydantic (Logfire and Pydantic AI price calls with it), MIT,
released often (price changes come as patch releases), a ~170 KB wheel whose data is a Python
module read from the installed package (its updater, which fetches, is opt-in and never
started here), and it finds a provider by its API URL.
The alternatives: litellm's `model_prices_and_context_window.json` comes inside litellm (a
large dependency with many of its own) and litellm fetches the remote copy at import unless
told not to; `tokencost` copies litellm's data, was last released in August 2025, and pulls
tiktoken, anthropic and aiohttp.

A call's cost is computed from the gateway-measured input and output tokens of that call, at
the rates in force now (tiered rates by the call's size included), for the model its request
names (`CallPrices`: a payload that calls another model than the run's is charged that
model's price, and a call to a model with no known price stops the batch). The gateway measures no
cached tokens, so every input token is charged at the full input rate: the count errs high.
"""

from __future__ import annotations

import importlib.util
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from decimal import Decimal, InvalidOperation
from typing import Any

from ..errors import ConfigError
from ..models import ModelSpec, parse_model

#: A price as the user gives it: US dollars per million (input, output) tokens.
Rates = tuple[Decimal, Decimal]
MILLION = Decimal(1_000_000)

PRICE_FORMAT = "MODEL=IN/OUT (US dollars per million input/output tokens)"
PRICE_EXAMPLE = "--price openai:gpt-4o-mini=0.15/0.60"


@dataclass(frozen=True)
class Pricing:
    """The price of one model: `cost(input, output)` of one call, in US dollars."""

    #: The model as `--model` spells it (`provider:model_id`).
    model: str
    #: `--price`, `mock (...)`, or `genai-prices X.Y.Z` (bundled).
    source: str
    #: The standard rates per million input and output tokens (for display; a bundled price
    #: may have tiers, applied by `cost`).
    input_per_mtok: Decimal
    output_per_mtok: Decimal
    calc: Callable[[int, int], Decimal] | None = field(default=None, compare=False, repr=False)

    def cost(self, input_tokens: int, output_tokens: int) -> Decimal:
        if self.calc is not None:
            return self.calc(input_tokens, output_tokens)
        return (input_tokens * self.input_per_mtok + output_tokens * self.output_per_mtok) / MILLION

    def describe(self) -> str:
        """`openai:gpt-4o-mini at $0.15/$0.6 per million input/output tokens, from --price`."""
        rates = (f"{rate.normalize():f}" for rate in (self.input_per_mtok, self.output_per_mtok))
        return f"{self.model} at ${'/$'.join(rates)} per million input/output tokens, from " + (
            self.source
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "source": self.source,
            "input_per_mtok": float(self.input_per_mtok),
            "output_per_mtok": float(self.output_per_mtok),
        }


def model_key(model: ModelSpec) -> str:
    """A model as `--model` and `--price` spell it: `provider:model_id`."""
    return f"{model.provider}:{model.model_id}"


def dollars(value: Any, what: str, fix: str, *, positive: bool) -> Decimal:
    """`value` (a number, or its text with an optional `$`) as a finite Decimal of at least 0
    (more than 0 when `positive`), else ConfigError."""
    amount = Decimal("NaN")
    if isinstance(value, Decimal):
        amount = value
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        amount = Decimal(repr(value))  # 0.1 stays 0.1, not its binary neighbour
    elif isinstance(value, str):
        try:
            amount = Decimal(value.strip().removeprefix("$"))
        except InvalidOperation:
            pass
    if (
        not amount.is_finite()
        or not math.isfinite(float(amount))
        or amount < 0
        or (positive and not amount)
    ):
        kind = "a positive amount" if positive else "an amount of 0 or more"
        raise ConfigError(f"{what} must be {kind} in US dollars, not {value!r}.", fix)
    return amount


def parse_max_cost(value: Any) -> Decimal:
    """`--max-cost` as a Decimal (ConfigError unless a positive finite amount)."""
    return dollars(
        value,
        "--max-cost",
        "Give the batch's cap in US dollars, e.g. --max-cost 5 or 0.50; leave it out for no cap.",
        positive=True,
    )


def parse_price(text: str) -> tuple[str, Rates]:
    """`MODEL=IN/OUT` -> (`provider:model_id`, (in, out)); ConfigError naming the format."""
    model, sep, rates = str(text).rpartition("=")
    inp, slash, out = rates.partition("/")
    fix = f"Give it as {PRICE_FORMAT}, e.g. {PRICE_EXAMPLE}."
    if not sep or not model.strip() or not slash:
        raise ConfigError(f"--price {text!r} is not {PRICE_FORMAT}.", fix)
    return model.strip(), (
        dollars(inp, f"--price {text!r}: the input price", fix, positive=False),
        dollars(out, f"--price {text!r}: the output price", fix, positive=False),
    )


def check_prices(prices: Mapping[str, Any]) -> dict[str, Rates]:
    """The user's prices (`BatchSpec.prices`: `{"openai:gpt-4o-mini": (0.15, 0.60)}`), each
    model named as `--model` spells it and each rate checked; keyed by `model_key`."""
    checked: dict[str, Rates] = {}
    for name, rates in prices.items():
        try:
            key = model_key(parse_model(name))
        except ConfigError as exc:
            raise ConfigError(f"--price names the model {name!r}: {exc.cause}", exc.fix) from None
        fix = f"Give it as {PRICE_FORMAT}, e.g. {PRICE_EXAMPLE}."
        if not isinstance(rates, (tuple, list)) or len(rates) != 2:
            raise ConfigError(f"The price of {name} must be (input, output), not {rates!r}.", fix)
        checked[key] = (
            dollars(rates[0], f"The input price of {name}", fix, positive=False),
            dollars(rates[1], f"The output price of {name}", fix, positive=False),
        )
    return checked


def bundled_pricing(model: ModelSpec) -> Pricing | None:
    """The model's price from genai-prices' bundled data (offline), or None: not installed,
    not a provider's list price (a local server, `hf`), or a model it does not know."""
    if model.provider not in ("openai", "litellm"):
        return None
    try:
        import genai_prices
        from genai_prices import Usage, calc_price
    except ImportError:  # Python 3.10 (it needs 3.11+), or removed: --price still works
        return None

    def calc(input_tokens: int, output_tokens: int) -> Decimal:
        """Found by the endpoint's URL (OpenAI, Groq, OpenRouter...), or by litellm's
        `provider/model` name."""
        usage = Usage(input_tokens=input_tokens, output_tokens=output_tokens)
        now = datetime.now(timezone.utc)
        if model.api_base:
            price = calc_price(
                usage,
                model.model_id,
                provider_api_url=model.api_base,
                genai_request_timestamp=now,
            )
        else:
            price = calc_price(
                usage, model.model_id, provider_id="litellm", genai_request_timestamp=now
            )
        return Decimal(price.total_price)

    try:
        rates = calc(1_000_000, 0), calc(0, 1_000_000)
    except (LookupError, ValueError, TypeError):  # unknown provider or model, odd units
        return None
    return Pricing(model_key(model), f"genai-prices {genai_prices.__version__}", *rates, calc)


class CallPrices:
    """The price of each model call by the model its request names (the gateway reads it:
    the provider bills that one, whatever the run was given): the batch's `base` price for
    its own model (or a call that names none), else the named model at the same endpoint,
    from `user` prices or the bundle, looked up once; None when it has no known price."""

    def __init__(self, base: Pricing, model: ModelSpec, user: Mapping[str, Rates]) -> None:
        self.base = base
        self.model = model
        self.user = dict(user)
        self._found: dict[str, Pricing | None] = {}
        self._lock = threading.Lock()

    def __call__(self, named: str | None) -> Pricing | None:
        own = self.model.model_id
        # litellm's `provider/model` reaches the provider as `model`.
        if named is None or named == own or own.endswith(f"/{named}"):
            return self.base
        with self._lock:
            if named not in self._found:
                try:
                    self._found[named] = pricing_for(replace(self.model, model_id=named), self.user)
                except ConfigError:
                    self._found[named] = None
            return self._found[named]


def pricing_for(model: ModelSpec, user: Mapping[str, Rates]) -> Pricing:
    """The model's price (the module's order), or ConfigError saying how to give one."""
    key = model_key(model)
    if key in user:
        return Pricing(key, "--price", *user[key])
    if model.provider == "mock":
        return Pricing(key, "mock (no model is called)", Decimal(0), Decimal(0))
    found = bundled_pricing(model)
    if found is not None:
        return found
    where = f" at {model.api_base}" if model.api_base else ""
    bundle = (
        "the prices bundled with genai-prices cover hosted providers' list prices, not this "
        "model or endpoint"
        if importlib.util.find_spec("genai_prices") is not None
        else "genai-prices, whose bundled prices cover hosted models, is not installed (it "
        "needs Python 3.11+)"
    )
    raise ConfigError(
        f"--max-cost needs the price of {key}{where}, and none is known: {bundle}.",
        f"Give it with --price {key}=IN/OUT (US dollars per million input/output tokens, "
        "e.g. 0.15/0.60; 0/0 for a server that bills nothing); nothing was started.",
    )


def plan_pricing(
    max_cost: Any,
    prices: Mapping[str, Any],
    models: Mapping[str, ModelSpec],
    gateway_off: Mapping[str, str | None],
) -> Pricing | None:
    """The price a batch's cost cap counts with (None: no `--max-cost`), checked before
    anything starts. `models`: each task's model; `gateway_off`: why a task's run has no
    model gateway (None: it has one). ConfigError (exit 2) for a price without a cap, a
    price of a model the batch does not use, a model with no price, or runs whose tokens the
    host cannot measure (no gateway): a cost cap counts measured tokens only."""
    user = check_prices(prices)
    if max_cost is None:
        if user:
            raise ConfigError(
                "--price is used only to count the cost against --max-cost, which is not set.",
                "Add --max-cost USD, or leave the --price options out.",
            )
        return None
    parse_max_cost(max_cost)
    keys = {model_key(m): m for m in models.values()}
    # A price for another model of the same provider prices the calls that name it (a
    # payload may call several); one of another provider can price nothing: a typo.
    providers = {m.provider for m in keys.values()}
    unused = sorted(k for k in user if k.partition(":")[0] not in providers)
    if unused:
        raise ConfigError(
            f"--price names {', '.join(unused)}, which this batch cannot call (its model: "
            f"{', '.join(sorted(keys))}).",
            "Spell the model as --model does (provider:model_id), or leave that --price out.",
        )
    unmeasured = {model_key(models[t]): why for t, why in gateway_off.items() if why}
    unmeasured = {k: why for k, why in unmeasured.items() if keys[k].provider != "mock"}
    if unmeasured:
        key, why = next(iter(unmeasured.items()))
        raise ConfigError(
            f"--max-cost counts only the tokens the model gateway measures on the host, and "
            f"the runs of {key} have no gateway ({why}): their spend could not be counted.",
            "Run them through the gateway (leave out --no-gateway; use a backend that has "
            "one), or cap what the sandboxes report with --max-total-tokens instead.",
        )
    (pricing, *others) = [pricing_for(m, user) for m in keys.values()]
    if others:  # the model is batch-wide today (`plan.fingerprint`); say so if that changes
        raise ConfigError("--max-cost counts one model per batch.", "Run one batch per model.")
    return pricing
