"""Moving models between apps without touching their tables: the migration operations it takes.

A model that moves keeps its table (``db_table``); the new app's first migration creates it in the
migration *state* only, the old app's deletes it from the state only, and the content types (and
with them the permissions and admin log entries that point at them) are relabelled, so nothing in
the database is recreated and no row is lost.
"""

from django.db import migrations


def content_types_moved(from_label: str, to_label: str, models: list[str]) -> migrations.RunPython:
    """Relabel the moved models' content types (forwards and back)."""

    def relabel(source: str, target: str):
        def run(apps, schema_editor) -> None:
            ContentType = apps.get_model("contenttypes", "ContentType")
            ContentType.objects.using(schema_editor.connection.alias).filter(
                app_label=source, model__in=[name.lower() for name in models]
            ).update(app_label=target)

        return run

    return migrations.RunPython(relabel(from_label, to_label), relabel(to_label, from_label))


def state_only(*operations) -> migrations.SeparateDatabaseAndState:
    """These operations change the migration state only; the tables already are as they say."""
    return migrations.SeparateDatabaseAndState(state_operations=list(operations), database_operations=[])
