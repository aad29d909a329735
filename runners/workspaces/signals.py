"""What workspaces tell the apps above them (notifications), which they never import.

- ``workspace_culled`` (``workspace``, ``reason``): the idle cull stopped a workspace, sent inside the
  transaction that stopped it; its owner is told.
"""

from django.dispatch import Signal

workspace_culled = Signal()
