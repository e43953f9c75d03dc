"""Exceptions raised by the pure core. Each names the offending field and the allowed range."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request (or its sampling parameters) is malformed or can never fit the engine; state is unchanged."""


class InvalidConfigError(ValueError):
    """A configuration value is out of its allowed range."""


class PlanMismatchError(RuntimeError):
    """A plan or a sampled-token list does not match the state it is applied to (stale, reordered, wrong size)."""
