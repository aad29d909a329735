"""The `portal` command (the entry point `portal = gpuportal.cli:main`)."""

from gpuportal.cli.app import app, main

__all__ = ["app", "main"]
