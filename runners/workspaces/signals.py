"""What workspaces tell the apps above them (notifications), which they never import.

- ``workspace_stopped`` (``workspace``, ``reason``, ``cause``): the portal stopped a workspace its owner had not
  (``cause`` "idle": the idle cull; "preempted": another tenant's guaranteed work), sent inside the
  transaction that wrote it; its owner is told.
"""

from django.dispatch import Signal

workspace_stopped = Signal()
