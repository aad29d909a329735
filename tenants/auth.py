"""API token authentication: django-rest-knox's, noting when each token was last used."""

from datetime import timedelta

from django.utils import timezone
from knox.auth import TokenAuthentication as KnoxTokenAuthentication
from knox.signals import token_expired
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

    def _cleanup_token(self, auth_token) -> bool:
        """knox's rule (the user's other expired tokens are deleted; an expired token is deleted and refused), with
        the database asked for the expired ones alone: knox loads every token of the user at every request, so a
        user who signs in from each CI run, holding hundreds, made every call of theirs read them all."""
        now = timezone.now()
        expired = auth_token.user.auth_token_set.filter(expiry__lt=now).exclude(digest=auth_token.digest)
        username = auth_token.user.get_username()
        for other in expired:
            other.delete()
            token_expired.send(sender=self.__class__, username=username, source="other_token")
        if auth_token.expiry is not None and auth_token.expiry < now:
            auth_token.delete()
            token_expired.send(sender=self.__class__, username=username, source="auth_token")
            return True
        return False
