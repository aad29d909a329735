"""The `portal` command (the entry point `portal = gpuportal.cli:main`)."""

from gpuportal.cli.commands import app, main

__all__ = ["app", "main"]
