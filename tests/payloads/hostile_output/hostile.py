"""One CodeAgent; the mock script (manifest.toml) writes the hostile output."""

import sys

from smolagents import CodeAgent

print('<script>window.__pwned = "stderr"</script>', file=sys.stderr)


def build(model):
    return CodeAgent(tools=[], model=model, max_steps=2)
