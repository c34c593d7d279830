#!/usr/bin/env bash
# The quick start: set up, then run the research_team example with the scripted mock model.
# The first run builds the hardened agent image (a few minutes); later runs reuse it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/orchestrator run agent_payloads/research_team --model mock "$@"
