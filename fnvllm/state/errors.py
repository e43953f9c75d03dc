"""Exceptions raised by the pure core. Each names the offending field, the value and what is allowed.

A value of the wrong *type* raises the ``*TypeError`` subclass of the same error, which is also a ``TypeError``:
``except InvalidRequestError`` catches every bad request, ``except TypeError`` keeps working for callers that
only expect Python's own type errors.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request (or its sampling parameters) is malformed or can never fit the engine; state is unchanged."""


class RequestTypeError(InvalidRequestError, TypeError):
    """A request value of the wrong type (a str where a number belongs, a bool where an int belongs, ...)."""


class InvalidConfigError(ValueError):
    """A configuration value is out of its allowed range."""


class ConfigTypeError(InvalidConfigError, TypeError):
    """A configuration value of the wrong type."""


class PlanMismatchError(RuntimeError):
    """A plan or a sampled-token list does not match the state it is applied to (stale, reordered, wrong size,
    or a sampled token outside the vocabulary)."""
