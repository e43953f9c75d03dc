"""``python -m fnvllm``: the ``fnvllm`` command."""

from fnvllm.cli import entry_point

entry_point()
