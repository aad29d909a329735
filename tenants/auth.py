"""API token authentication: django-rest-knox's, noting when each token was last used."""

from datetime import timedelta

from django.utils import timezone
from knox.auth import TokenAuthentication as KnoxTokenAuthentication
from rest_framework.exceptions import AuthenticationFailed

from tenants.models import TokenInfo

# "Last used" is kept to the minute: one conditional UPDATE a minute per token, not one per request.
LAST_USED_RESOLUTION = timedelta(minutes=1)


class TokenAuthentication(KnoxTokenAuthentication):
    def authenticate_credentials(self, token):
        try:
            token.decode("utf-8")
        except UnicodeDecodeError:  # knox decodes it unguarded: a header with a byte like 0xff would be a 500
            raise AuthenticationFailed("Invalid token.") from None
        user, auth_token = super().authenticate_credentials(token)
        now = timezone.now()
        TokenInfo.objects.filter(token=auth_token).exclude(last_used_at__gt=now - LAST_USED_RESOLUTION).update(
            last_used_at=now
        )
        return user, auth_token
