"""smolagents' own tutorial "Orchestrate a multi-agent system", moved into a sandbox.

The code is the tutorial's, as written (https://huggingface.co/docs/smolagents/examples/multiagents),
apart from what every payload changes: the model is handed in (`build_manager(model)`) instead
of built here, there is no `login()` (the host holds the credential) and no
`manager_agent.run(question)` (the runtime runs the manager with the run's task). The program
keeps its own settings: the manager's `additional_authorized_imports` (the manifest grants the
same list: it is the ceiling, and `orchestrator validate` names any import it does not grant)
and smolagents' default `max_steps` (20) for the manager.
"""

import re

import requests
from markdownify import markdownify
from requests.exceptions import RequestException
from smolagents import (
    CodeAgent,
    ToolCallingAgent,
    WebSearchTool,
    tool,
)


@tool
def visit_webpage(url: str) -> str:
    """Visits a webpage at the given URL and returns its content as a markdown string.

    Args:
        url: The URL of the webpage to visit.

    Returns:
        The content of the webpage converted to Markdown, or an error message if the request fails.
    """
    try:
        # Send a GET request to the URL
        response = requests.get(url)
        response.raise_for_status()  # Raise an exception for bad status codes

        # Convert the HTML content to Markdown
        markdown_content = markdownify(response.text).strip()

        # Remove multiple line breaks
        markdown_content = re.sub(r"\n{3,}", "\n\n", markdown_content)

        return markdown_content

    except RequestException as e:
        return f"Error fetching the webpage: {str(e)}"
    except Exception as e:
        return f"An unexpected error occurred: {str(e)}"


def build_manager(model):
    """The entrypoint: the tutorial's two agents, on the model the runtime hands in."""
    web_agent = ToolCallingAgent(
        tools=[WebSearchTool(), visit_webpage],
        model=model,
        max_steps=10,
        name="web_search_agent",
        description="Runs web searches for you.",
    )

    manager_agent = CodeAgent(
        tools=[],
        model=model,
        managed_agents=[web_agent],
        additional_authorized_imports=["time", "numpy", "pandas"],
    )
    return manager_agent
