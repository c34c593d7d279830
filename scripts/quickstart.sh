#!/usr/bin/env bash
# The quick start: set up, then run the research_team example with the scripted mock model.
# The first run builds the hardened agent image (a few minutes); later runs reuse it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "quickstart: running the research_team example; the first run builds the agent image" \
    "(a few minutes, each step shown)" >&2
status=0
.venv/bin/orchestrator run agent_payloads/research_team --model mock "$@" || status=$?
cat >&2 <<'NEXT'

quickstart: the InterpreterError above is part of the example: the scripted librarian first
reads a "year" key the knowledge base does not have, then recovers with "opened".
quickstart: `orchestrator` is in .venv/bin. In a new shell, first run
    source .venv/bin/activate
then, for example:
    orchestrator new --program hello && orchestrator run hello.py    # a smolagents program, as written
    orchestrator run research_team "How many years after the Eiffel Tower opened did the Golden Gate Bridge open?"
    orchestrator runs list
    orchestrator --help
NEXT
exit "$status"
