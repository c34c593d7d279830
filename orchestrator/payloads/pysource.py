"""Python source parsed on the host, one thread at a time, and the name a call is made by.

CPython 3.11's `ast.parse` keeps its AST-building recursion depth in interpreter-wide state;
two threads parsing at once (eight runs started by a batch's threads, say) can interleave
there and one of them fails with `SystemError: AST constructor recursion depth mismatch`
(python/cpython#106905 and its kin). A parse takes milliseconds, so a process-wide lock
costs nothing a user can see and makes the error impossible.
"""

from __future__ import annotations

import ast
import threading

_PARSING = threading.Lock()


def parse(source: str | bytes, filename: str = "<unknown>") -> ast.Module:
    """`ast.parse` under the process-wide lock; raises what it raises (SyntaxError,
    ValueError for a NUL byte)."""
    with _PARSING:
        return ast.parse(source, filename=filename)


def callee(func: ast.expr) -> str | None:
    """The name a call or reference is made by: `X` of `X(...)` and of `a.b.X(...)`."""
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None
