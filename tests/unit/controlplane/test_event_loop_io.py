"""No database call on the control plane's event loop: a coroutine that opened a session (or
called a function that does, took the request's session as a dependency, migrated or pinged
the database) would run synchronous SQLAlchemy on the loop, and one slow round trip would stall every stream the
router proxies. Database work sits in plain functions that coroutines run with
``asyncio.to_thread``; ``tests/integration/controlplane/test_router_path.py`` measures it."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

CONTROLPLANE = Path(__file__).resolve().parents[3] / "controlplane" / "src"
# Database methods (``Database``'s and a SQLAlchemy engine's) that block when called.
BLOCKING = {"session", "sessions", "migrate", "ping", "connect", "begin", "close", "dispose"}
DATABASES = {"db", "database", "engine", "sessions"}  # what the code names them


def blocking_functions(sources: Iterable[str]) -> set[str]:
    """Names of the plain functions and methods that call the database, directly or through
    another of them called by name or on ``self`` (what a coroutine must hand to
    ``asyncio.to_thread``, not call). A name some ``async def`` also has is left out: a call
    of it may be the coroutine's."""
    bodies: dict[str, list[ast.AST]] = {}
    coroutines: set[str] = set()
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef) and node.name not in BLOCKING:
                bodies.setdefault(node.name, []).append(node)
            elif isinstance(node, ast.AsyncFunctionDef):
                coroutines.add(node.name)
    found: set[str] = set()
    while True:
        more = {
            name
            for name, defs in bodies.items()
            if name not in found | coroutines
            and any(_blocks(n, found) for d in defs for n in ast.walk(d) if n is not d)
        }
        if not more:
            return found
        found |= more


def blocking_calls(source: str, functions: set[str]) -> list[str]:
    """``line: call`` for each database call, or call of one of ``functions``, made directly
    in the body of an ``async def`` (not in a function nested in it, which is what
    ``asyncio.to_thread`` runs), and each ``async def`` that takes the request's session
    (``SessionDep``)."""
    found: list[str] = []

    def visit(node: ast.AST, in_coroutine: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.AsyncFunctionDef):
                arguments = child.args.args + child.args.kwonlyargs
                if any(
                    a.annotation and "SessionDep" in ast.unparse(a.annotation) for a in arguments
                ):
                    found.append(f"{child.lineno}: async def {child.name}(... SessionDep ...)")
                visit(child, True)
            elif isinstance(child, (ast.FunctionDef, ast.Lambda)):
                visit(child, False)
            else:
                if in_coroutine and _blocks(child, functions):
                    found.append(f"{child.lineno}: {ast.unparse(child)}")
                visit(child, in_coroutine)

    visit(ast.parse(source), False)
    return found


def _blocks(node: ast.AST, functions: set[str]) -> bool:
    """A call of a blocking method on something named like a database or an engine
    (``self.db.session()``, ``services.db.ping()``, ``engine.connect()``), or of one of
    ``functions`` (``self._set_rows(...)``, ``mark_lost(...)``)."""
    if not isinstance(node, ast.Call):
        return False
    if isinstance(node.func, ast.Name):
        return node.func.id in functions
    if not isinstance(node.func, ast.Attribute):
        return False
    owner = ast.unparse(node.func.value)
    if node.func.attr in BLOCKING and owner.rsplit(".", 1)[-1] in DATABASES:
        return True
    return owner == "self" and node.func.attr in functions


def test_no_coroutine_of_the_control_plane_calls_the_database() -> None:
    sources = {path: path.read_text() for path in sorted(CONTROLPLANE.rglob("*.py"))}
    functions = blocking_functions(sources.values())
    assert {"_set_rows", "mark_lost", "_register"} <= functions  # the check sees through calls
    offenders = {
        str(path.relative_to(CONTROLPLANE)): calls
        for path, source in sources.items()
        if (calls := blocking_calls(source, functions))
    }
    assert not offenders, offenders


def test_the_check_finds_a_session_opened_in_a_coroutine() -> None:
    source = """
async def run(self):
    with self.db.session() as session:
        session.get(Operation, 1)
    await asyncio.to_thread(self._write)
    self._write_twice()

def _write(self):
    with self.db.session() as session:
        session.add(row)

def _write_twice(self):
    self._write()

async def handler(body: Body, session: SessionDep):
    async def inner():
        services.db.migrate()
    await asyncio.to_thread(lambda: services.db.ping())
"""
    functions = blocking_functions([source])
    assert functions == {"_write", "_write_twice"}
    assert blocking_calls(source, functions) == [
        "3: self.db.session()",
        "6: self._write_twice()",
        "15: async def handler(... SessionDep ...)",
        "17: services.db.migrate()",
    ]
