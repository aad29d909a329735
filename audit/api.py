"""REST API of the audit log: read-only. Staff read every entry, a tenant's owners and admins their
tenant's; any other entry is not in the list, and its detail is a 404. Nothing here writes."""

from rest_framework import mixins, serializers, viewsets
from rest_framework.routers import SimpleRouter

from audit import selectors
from audit.filters import AuditEntryFilter
from audit.models import AuditEntry


class AuditEntrySerializer(serializers.ModelSerializer):
    actor = serializers.CharField(source="actor_name", read_only=True,
                                  help_text='The username of who made the change, or "scheduler" / "system".')
    tenant = serializers.CharField(source="tenant_slug", read_only=True,
                                   help_text="The tenant's slug; empty for changes of no tenant (flavors, tokens, ...).")
    before = serializers.JSONField(read_only=True, allow_null=True, help_text="The changed fields before; null for a creation.")
    after = serializers.JSONField(read_only=True, allow_null=True, help_text="The changed fields after; null for a deletion.")

    class Meta:
        model = AuditEntry
        fields = ["id", "at", "actor", "tenant", "action", "object_type", "object_id", "object_repr", "before", "after",
                  "request_id"]
        read_only_fields = fields


class AuditEntryViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """The audit log, newest first: who changed what, when, and the changed fields before and after."""

    serializer_class = AuditEntrySerializer
    filterset_class = AuditEntryFilter
    queryset = AuditEntry.objects.none()  # the schema's model; get_queryset scopes it
    lookup_value_regex = r"\d{1,18}"  # anything else (a word, a number past bigint) is no route: a 404

    def get_queryset(self):
        return selectors.entry_list(user=self.request.user)


router = SimpleRouter()
router.register("audit", AuditEntryViewSet, basename="audit-entry")
