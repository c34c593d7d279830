"""An agent answers, then the program raises: the run failed, with the traceback."""

from smolagents import CodeAgent, InferenceClientModel

agent = CodeAgent(tools=[], model=InferenceClientModel())
answer = agent.run("Say hi.")
raise RuntimeError(f"the program gave up after {answer!r}")
