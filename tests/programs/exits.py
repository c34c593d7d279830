"""Exits with the code given as its first argument, having run no agent."""

import sys

print("exiting with", sys.argv[1])
sys.exit(int(sys.argv[1]))
