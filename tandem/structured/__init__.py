"""Constrained decoding shared by both services: a request's constraint, compiled into grammar matchers."""
from tandem.structured.constraint import Constraint, ConstraintError
from tandem.structured.grammar import CompiledGrammar, GrammarCompiler, GrammarLimits, TokenMasker

__all__ = ["CompiledGrammar", "Constraint", "ConstraintError", "GrammarCompiler", "GrammarLimits", "TokenMasker"]
