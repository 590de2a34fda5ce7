"""Each constrained request's grammar matcher: compiled off the event loop, with a deadline, cached by content."""
from __future__ import annotations

import asyncio

from target_service.errors import invalid
from target_service.metrics import TargetMetrics
from tandem.structured import CompiledGrammar, Constraint, ConstraintError, GrammarCompiler
from tandem.structured.grammar import Matcher


class RequestGrammars:
    def __init__(self, compiler: GrammarCompiler, metrics: TargetMetrics):
        self.compiler = compiler
        self.metrics = metrics

    async def matchers_for(self, constraint: Constraint, count: int) -> list[Matcher]:
        """count fresh matchers for the constraint (one per sample); INVALID_ARGUMENT naming its field
        when it cannot be compiled.

        A compile past the deadline is abandoned by this request, not stopped: the parser's limits
        bound it, and its grammar is cached for the next request that sends the same constraint.
        """
        self.metrics.child(self.metrics.structured_requests, kind=constraint.kind).inc()
        compiled = self.compiler.cached(constraint)
        if compiled is None:
            compiled = await self._compile(constraint)
            self.metrics.grammar_compile.observe(compiled.compile_seconds)
        return [compiled.matcher() for _ in range(count)]

    async def _compile(self, constraint: Constraint) -> CompiledGrammar:
        timeout = self.compiler.limits.compile_seconds
        try:
            return await asyncio.wait_for(asyncio.to_thread(self.compiler.compile, constraint), timeout)
        except ConstraintError as err:
            raise invalid(err.field, err.problem) from err
        except asyncio.TimeoutError as err:
            raise invalid(constraint.field, f"took longer than {timeout:g} s to compile; simplify it") from err
