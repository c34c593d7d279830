"""The program's tools: an MCP server (FastMCP) that `main.py` starts over stdio."""

import os

from mcp.server.fastmcp import FastMCP

server = FastMCP("almanac")

BOOKS = {"dune": ("Frank Herbert", 1965), "solaris": ("Stanisław Lem", 1961)}


@server.tool()
def book_facts(title: str) -> str:
    """Who wrote a book, and when.

    Args:
        title: the book's title, e.g. "Dune".
    """
    author, year = BOOKS.get(title.strip().lower(), ("unknown", 0))
    # The server's process id: the answer could only come from this process.
    return f"{title} was written by {author} in {year} (almanac pid {os.getpid()})"


if __name__ == "__main__":
    server.run()  # stdio
