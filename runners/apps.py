from django.apps import AppConfig


class RunnersConfig(AppConfig):
    """The layer "where work runs". Its own models moved to the apps inside it (clusters,
    environments, jobs, scheduling); this app keeps their migration history up to the move
    (runners/migrations/0001-0007), so a database made before the move migrates on."""

    name = "runners"
    verbose_name = "Where work runs (migration history)"
