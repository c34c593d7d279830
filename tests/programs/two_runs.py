"""Two top-level agents run one after the other; the run's answer is the last one's.
The second asks for an E2B executor, which the sandbox must not start (the local one runs)."""

import sys

from smolagents import CodeAgent, InferenceClientModel

first = CodeAgent(tools=[], model=InferenceClientModel(), name="first")
second = CodeAgent(tools=[], model=InferenceClientModel(), executor_type="e2b")
print("first says", first.run("Add 1 and 2."))
print("second says", second.run("Multiply 6 and 7.", max_steps=999))
print("argv", sys.argv[1:])
