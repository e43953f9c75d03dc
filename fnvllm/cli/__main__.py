"""``python -m fnvllm.cli``."""

from fnvllm.cli import entry_point

entry_point()
