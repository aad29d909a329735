"""API token authentication: django-rest-knox's tokens, checked in one query, noting when each was last used.

Knox's own check runs three queries a request: the tokens under the key prefix, then every other token of
the same user (deleting the expired ones), then ours noting the last use. Here the token, its user and what
the portal keeps beside it (TokenInfo) come in one query; the last use is written at most once a minute; an
expired token is refused and deleted when it is sent, as knox does. The owner's other expired tokens are
not swept on every request: they are refused all the same, and `token_list` leaves them out.
"""

import binascii
from datetime import timedelta
from hmac import compare_digest

from django.core.exceptions import ObjectDoesNotExist
from django.utils import timezone
from django.utils.translation import gettext_lazy as _
from knox.auth import TokenAuthentication as KnoxTokenAuthentication
from knox.crypto import hash_token
from knox.models import AuthToken
from knox.settings import CONSTANTS
from knox.signals import token_expired
from rest_framework import exceptions

from tenants.models import TokenInfo

# "Last used" is kept to the minute: one conditional UPDATE a minute per token, not one per request.
LAST_USED_RESOLUTION = timedelta(minutes=1)


class TokenAuthentication(KnoxTokenAuthentication):
    def authenticate_credentials(self, token):
        refused = exceptions.AuthenticationFailed(_("Invalid token."))
        try:
            token = token.decode("utf-8")
            digest = hash_token(token)
        except (UnicodeDecodeError, TypeError, ValueError, binascii.Error):
            raise refused from None
        now = timezone.now()
        candidates = AuthToken.objects.filter(token_key=token[: CONSTANTS.TOKEN_KEY_LENGTH]).select_related("user", "info")
        for auth_token in candidates:
            if not compare_digest(digest, auth_token.digest):
                continue
            if auth_token.expiry is not None and auth_token.expiry < now:
                username = auth_token.user.get_username()
                auth_token.delete()
                token_expired.send(sender=self.__class__, username=username, source="auth_token")
                raise refused
            user, auth_token = self.validate_user(auth_token)
            self._note_use(auth_token, now)
            return user, auth_token
        raise refused

    @staticmethod
    def _note_use(auth_token: AuthToken, now) -> None:
        try:
            last_used = auth_token.info.last_used_at
        except ObjectDoesNotExist:  # a token made outside the portal's services (knox's own views, a shell)
            return
        if last_used is not None and last_used > now - LAST_USED_RESOLUTION:
            return
        # Conditional, so that concurrent requests of one token write it once.
        TokenInfo.objects.filter(token=auth_token).exclude(last_used_at__gt=now - LAST_USED_RESOLUTION).update(
            last_used_at=now
        )
