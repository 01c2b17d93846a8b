"""Kept so that `from minillm.cli import app` keeps working; the commands live in minillm/commands/."""
from minillm.commands import app, main  # noqa: F401
