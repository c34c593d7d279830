"""Reads its own options with argparse, as a script run with `python ask.py --question ...`
does; `--model` is an option orchestrator has too. Runs no agent."""

import argparse

parser = argparse.ArgumentParser()
parser.add_argument("--question", required=True)
parser.add_argument("--model", default="its own")
args = parser.parse_args()
print(f"question={args.question!r} model={args.model!r}")
