"""Structured output: cheap checks of a request's spec, grammar compilation in bounded worker processes, and each
constrained request's token mask."""
