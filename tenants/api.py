"""REST API for tenants, members and API tokens."""

from django.contrib.auth import authenticate
from django.db.models import OuterRef, Subquery
from django.shortcuts import get_object_or_404
from drf_spectacular.utils import extend_schema, inline_serializer
from knox.models import AuthToken
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.exceptions import AuthenticationFailed, Throttled
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.views import APIView

from common.fields import StrictTypesMixin
from tenants import login_throttle, selectors, services
from tenants.auth import TokenAuthentication
from tenants.models import (
    DNS_LABEL_MESSAGE,
    DNS_LABEL_RE,
    TENANT_SLUG_MAX,
    Membership,
    Role,
    Tenant,
    TokenInfo,
)
from tenants.scoping import TenantScopedMixin


def dns_label_field(max_length: int) -> serializers.RegexField:
    return serializers.RegexField(DNS_LABEL_RE, max_length=max_length, error_messages={"invalid": DNS_LABEL_MESSAGE})


# --- Tokens -----------------------------------------------------------------


class TokenRequestSerializer(StrictTypesMixin, serializers.Serializer):
    username = serializers.CharField(max_length=150)
    password = serializers.CharField(max_length=256, trim_whitespace=False, style={"input_type": "password"})


class TokenView(APIView):
    """Exchange a username and password for an API token, or revoke the token in use."""

    # Tokens only: a login carries its credentials in the body, so no session
    # (and no CSRF token) is involved, and DELETE revokes the token it was sent with.
    authentication_classes = [TokenAuthentication]
    permission_classes = [AllowAny]

    @extend_schema(
        request=TokenRequestSerializer,
        responses={201: inline_serializer("Token", {"token": serializers.CharField(), "expiry": serializers.DateTimeField()})},
        auth=[],
    )
    def post(self, request):
        # Every attempt counts, well-formed or not (tenants/login_throttle.py); revoking is not limited.
        username = request.data.get("username") if isinstance(request.data, dict) else None
        username = username if isinstance(username, str) else None
        wait_s = login_throttle.attempt(request, username)
        if wait_s is not None:
            raise Throttled(wait=wait_s, detail=login_throttle.throttled_message(wait_s))
        data = TokenRequestSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        user = authenticate(request, **data.validated_data)
        if user is None or not user.is_active:
            login_throttle.failed(request, username)
            raise AuthenticationFailed("Wrong username or password.")
        info, token = services.token_create(user=user, name="password login")
        return Response({"token": token, "expiry": info.token.expiry}, status=status.HTTP_201_CREATED)

    @extend_schema(responses={204: None})
    def delete(self, request):
        if not request.user.is_authenticated or not isinstance(request.auth, AuthToken):
            raise AuthenticationFailed("Send the token to revoke in the Authorization header.")
        services.token_revoke_own(token=request.auth)
        return Response(status=status.HTTP_204_NO_CONTENT)


class ApiTokenSerializer(serializers.ModelSerializer):
    user = serializers.CharField(source="token.user.username", read_only=True)
    created = serializers.DateTimeField(source="token.created", read_only=True)
    expiry = serializers.DateTimeField(source="token.expiry", read_only=True, allow_null=True)
    current = serializers.SerializerMethodField(help_text="Whether this is the token the request came with.")

    class Meta:
        model = TokenInfo
        fields = ["id", "name", "user", "created", "expiry", "last_used_at", "current"]

    def get_current(self, info: TokenInfo) -> bool:
        auth = self.context["request"].auth
        return isinstance(auth, AuthToken) and auth.pk == info.token_id


class ApiTokenCreateSerializer(StrictTypesMixin, serializers.Serializer):
    name = serializers.CharField(max_length=services.TOKEN_NAME_MAX)
    expires_in_days = serializers.IntegerField(
        min_value=1, max_value=services.TOKEN_MAX_DAYS, required=False,
        help_text="Without it the token lives API_TOKEN_TTL_HOURS.",
    )


class ApiTokenCreatedSerializer(ApiTokenSerializer):
    token = serializers.CharField(help_text="The secret: shown this once, never again.")

    class Meta(ApiTokenSerializer.Meta):
        fields = [*ApiTokenSerializer.Meta.fields, "token"]


class ApiTokenViewSet(mixins.ListModelMixin, viewsets.GenericViewSet):
    """Your API tokens: list (never the secrets), create (the secret shown once), revoke.
    Staff list another user's with `?user=` and may revoke anyone's; anyone else's token is a 404."""

    serializer_class = ApiTokenSerializer
    queryset = TokenInfo.objects.none()  # the schema's model; get_queryset scopes it
    lookup_value_regex = r"\d{1,18}"  # anything else (a word, a number past bigint) is no route: a 404

    def get_queryset(self):
        owner = self.request.query_params.get("user")
        return selectors.token_list(user=self.request.user, owner=owner)

    @extend_schema(request=ApiTokenCreateSerializer, responses={201: ApiTokenCreatedSerializer})
    def create(self, request):
        unknown = sorted(set(request.data) - set(ApiTokenCreateSerializer().fields)) if isinstance(request.data, dict) else []
        if unknown:
            raise serializers.ValidationError({unknown[0]: ["Unknown field; the fields are name and expires_in_days."]})
        data = ApiTokenCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        info, secret = services.token_create(user=request.user, **data.validated_data)
        body = ApiTokenSerializer(info, context={"request": request}).data
        return Response({**body, "token": secret}, status=status.HTTP_201_CREATED)

    @extend_schema(responses={204: None})
    def destroy(self, request, pk):
        services.token_revoke(actor=request.user, token_id=int(pk))
        return Response(status=status.HTTP_204_NO_CONTENT)


# --- Tenants ----------------------------------------------------------------


class TenantSerializer(serializers.ModelSerializer):
    my_role = serializers.SerializerMethodField()

    class Meta:
        model = Tenant
        fields = ["slug", "name", "created_at", "my_role", "allow_moves"]
        read_only_fields = fields

    def get_my_role(self, tenant: Tenant) -> str | None:
        user = self.context["request"].user
        if user.is_staff:
            return "owner"
        if hasattr(tenant, "membership_role"):  # annotated by the list, one query for all rows
            return tenant.membership_role
        return selectors.user_role(user=user, tenant=tenant)


class TenantCreateSerializer(StrictTypesMixin, serializers.Serializer):
    slug = dns_label_field(TENANT_SLUG_MAX)
    name = serializers.CharField(max_length=100)


class TenantUpdateSerializer(StrictTypesMixin, serializers.Serializer):
    allow_moves = serializers.BooleanField(
        help_text="Whether the scheduler may stop this tenant's preemptible jobs with a checkpoint and resume them "
                  "on another node to make room for a job that fits on no node. Tenant admins set it.")


class TenantViewSet(TenantScopedMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    queryset = Tenant.objects.all()
    scope_field = ""
    serializer_class = TenantSerializer
    lookup_field = "slug"
    lookup_value_regex = r"[a-z0-9-]+"  # the slug pattern, as on the members route

    def refine_queryset(self, queryset):
        role = Membership.objects.filter(tenant=OuterRef("pk"), user=self.request.user).values("role")[:1]
        return queryset.annotate(membership_role=Subquery(role))

    @extend_schema(request=TenantCreateSerializer, responses={201: TenantSerializer})
    def create(self, request):
        data = TenantCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        tenant = services.tenant_create(actor=request.user, **data.validated_data)
        return Response(TenantSerializer(tenant, context={"request": request}).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=TenantUpdateSerializer, responses={200: TenantSerializer})
    def partial_update(self, request, slug):
        tenant = self.get_object()
        data = TenantUpdateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        tenant = services.tenant_moves_set(actor=request.user, tenant=tenant, allow=data.validated_data["allow_moves"])
        return Response(TenantSerializer(tenant, context={"request": request}).data)


# --- Members ----------------------------------------------------------------


class MembershipSerializer(serializers.ModelSerializer):
    username = serializers.CharField(source="user.username")

    class Meta:
        model = Membership
        fields = ["username", "role", "created_at"]


class MembershipCreateSerializer(StrictTypesMixin, serializers.Serializer):
    username = serializers.CharField(max_length=150)
    role = serializers.ChoiceField(choices=Role.choices)


class MemberViewSet(TenantScopedMixin, viewsets.GenericViewSet):
    """Members of one tenant; the tenant comes from the URL and is scoped like any object."""

    queryset = Membership.objects.select_related("user", "tenant")
    serializer_class = MembershipSerializer
    lookup_field = "user__username"
    lookup_url_kwarg = "username"
    lookup_value_regex = r"[\w.@+-]+"

    def tenant(self) -> Tenant:
        return selectors.tenant_get(user=self.request.user, slug=self.kwargs["tenant_slug"])

    def refine_queryset(self, queryset):
        return queryset.filter(tenant=self.tenant()).order_by("user__username")

    def list(self, request, tenant_slug):
        page = self.paginate_queryset(self.get_queryset())
        return self.get_paginated_response(self.get_serializer(page, many=True).data)

    @extend_schema(request=MembershipCreateSerializer, responses={201: MembershipSerializer})
    def create(self, request, tenant_slug):
        tenant = self.tenant()
        data = MembershipCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        membership = services.membership_add(actor=request.user, tenant=tenant, **data.validated_data)
        return Response(MembershipSerializer(membership).data, status=status.HTTP_201_CREATED)

    @extend_schema(responses={204: None})
    def destroy(self, request, tenant_slug, username):
        tenant = self.tenant()
        get_object_or_404(self.get_queryset(), user__username=username)
        services.membership_remove(actor=request.user, tenant=tenant, username=username)
        return Response(status=status.HTTP_204_NO_CONTENT)
