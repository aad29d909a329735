"""REST API of notifications: a tenant's webhooks and their delivery log (owners), and your own mail choices."""

from django.shortcuts import get_object_or_404
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from common.errors import Invalid
from common.fields import StrictTypesMixin
from runners.notifications import selectors, services
from runners.notifications.models import Delivery, EventKind, Webhook
from tenants.scoping import TenantScopedMixin
from tenants.selectors import tenant_get

# --- Webhooks ---------------------------------------------------------------------------------------


class WebhookSerializer(serializers.ModelSerializer):
    events = serializers.ListField(child=serializers.ChoiceField(choices=EventKind.choices))
    created_by = serializers.CharField(source="created_by.username", read_only=True, allow_null=True, default=None)

    class Meta:
        model = Webhook
        fields = ["id", "url", "events", "active", "created_by", "created_at"]


class WebhookCreateSerializer(StrictTypesMixin, serializers.Serializer):
    url = serializers.CharField(max_length=services.URL_MAX, help_text="http:// or https://; POSTed every event.")
    events = serializers.ListField(
        child=serializers.ChoiceField(choices=EventKind.choices), allow_empty=False, max_length=len(EventKind.values),
        help_text="The events to send it.",
    )

    def validate_url(self, value: str) -> str:
        try:
            return services.webhook_url_check(value)
        except Invalid as exc:
            raise serializers.ValidationError(exc.message_dict["url"]) from None


class WebhookCreatedSerializer(WebhookSerializer):
    secret = serializers.CharField(
        help_text="The HMAC-SHA256 key of X-Portal-Signature: shown this once, never again."
    )

    class Meta(WebhookSerializer.Meta):
        fields = [*WebhookSerializer.Meta.fields, "secret"]


class DeliverySerializer(serializers.ModelSerializer):
    event = serializers.CharField(source="kind", help_text="The event kind (X-Portal-Event).")
    payload = serializers.JSONField(help_text="The JSON body POSTed (event, tenant, object, occurred_at, link).")

    class Meta:
        model = Delivery
        fields = ["id", "event", "state", "attempts", "status_code", "error", "next_try_at", "delivered_at",
                  "created_at", "payload"]


class WebhookViewSet(TenantScopedMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """A tenant's webhooks, for its owners: list, add (the secret shown once), delete, and each one's
    delivery log. Another tenant's is a 404; a member who is not an owner gets 403."""

    queryset = Webhook.objects.select_related("tenant", "created_by")
    serializer_class = WebhookSerializer
    lookup_value_regex = r"\d{1,18}"

    def refine_queryset(self, queryset):
        allowed = selectors.webhook_list(user=self.request.user, slug=self.kwargs["tenant_slug"])
        return queryset.filter(pk__in=allowed.values("pk")).order_by("id")

    def list(self, request, tenant_slug):
        page = self.paginate_queryset(self.get_queryset())
        return self.get_paginated_response(self.get_serializer(page, many=True).data)

    @extend_schema(request=WebhookCreateSerializer, responses={201: WebhookCreatedSerializer})
    def create(self, request, tenant_slug):
        self.get_queryset()  # 404 outside the tenant, 403 for members who are not owners, before the body
        unknown = sorted(set(request.data) - set(WebhookCreateSerializer().fields)) if isinstance(request.data, dict) else []
        if unknown:
            raise serializers.ValidationError({unknown[0]: ["Unknown field; the fields are url and events."]})
        data = WebhookCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        tenant = tenant_get(user=request.user, slug=tenant_slug)
        webhook = services.webhook_create(actor=request.user, tenant=tenant, **data.validated_data)
        return Response({**WebhookSerializer(webhook).data, "secret": webhook.secret}, status=status.HTTP_201_CREATED)

    @extend_schema(responses={204: None})
    def destroy(self, request, tenant_slug, pk):
        webhook = get_object_or_404(self.get_queryset(), pk=pk)
        services.webhook_delete(actor=request.user, webhook=webhook)
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(responses={200: DeliverySerializer(many=True)})
    @action(detail=True, methods=["get"], serializer_class=DeliverySerializer)
    def deliveries(self, request, tenant_slug, pk):
        """The webhook's delivery log, newest first: each event's state, tries, last answer and error."""
        webhook = get_object_or_404(self.get_queryset(), pk=pk)
        page = self.paginate_queryset(selectors.delivery_list(webhook))
        return self.get_paginated_response(DeliverySerializer(page, many=True).data)


# --- Your mail choices --------------------------------------------------------------------------------


def _email_fields() -> dict:
    return {kind: serializers.BooleanField(help_text=f"Mail me: {label.lower()}.") for kind, label in EventKind.choices}


EmailChoices = type("NotificationEmailChoices", (StrictTypesMixin, serializers.Serializer), _email_fields())


class PreferenceSerializer(serializers.Serializer):
    tenant = serializers.SlugField(read_only=True)
    email = EmailChoices(read_only=True)


class PreferenceChangeSerializer(serializers.Serializer):
    email = EmailChoices()


def _refuse_unknown(data, allowed: set[str], where: str = "") -> None:
    if isinstance(data, dict):
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise serializers.ValidationError(
                {f"{where}{unknown[0]}": [f"Unknown field; the fields are {', '.join(sorted(allowed))}."]}
            )


class NotificationPreferenceViewSet(viewsets.ViewSet):
    """Your own mail choices, one object per tenant you are a member of: which events you are mailed.

    Not tenant-scoped through TenantScopedMixin: these rows are the caller's own, read from their
    memberships; a tenant you are not a member of is a 404.
    """

    lookup_field = "tenant"
    lookup_value_regex = r"[a-z0-9-]+"
    serializer_class = PreferenceSerializer

    def _answer(self, tenant) -> dict:
        return {"tenant": tenant.slug, "email": selectors.preferences_of(user=self.request.user, tenant=tenant)}

    @extend_schema(responses={200: PreferenceSerializer(many=True)})
    def list(self, request):
        return Response([self._answer(tenant) for tenant in selectors.preference_tenants(user=request.user)])

    @extend_schema(responses={200: PreferenceSerializer})
    def retrieve(self, request, tenant):
        return Response(self._answer(selectors.preference_tenant(user=request.user, slug=tenant)))

    @extend_schema(request=PreferenceChangeSerializer, responses={200: PreferenceSerializer})
    def update(self, request, tenant):
        """Set every choice (each event is required)."""
        return self._change(request, tenant)

    @extend_schema(request=PreferenceChangeSerializer, responses={200: PreferenceSerializer})
    def partial_update(self, request, tenant):
        """Change the choices named; the others stay."""
        return self._change(request, tenant, partial=True)

    def _change(self, request, slug, *, partial=False):
        tenant = selectors.preference_tenant(user=request.user, slug=slug)
        _refuse_unknown(request.data, {"email"})
        if isinstance(request.data, dict):
            _refuse_unknown(request.data.get("email"), set(EventKind.values), "email.")
        data = PreferenceChangeSerializer(data=request.data, partial=partial)
        data.is_valid(raise_exception=True)
        services.preferences_set(user=request.user, tenant=tenant, choices=data.validated_data.get("email", {}))
        return Response(self._answer(tenant))
