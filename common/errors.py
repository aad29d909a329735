"""The portal's own exceptions: what services and selectors raise, whatever answers the request.

Below the views nothing speaks HTTP. A service says what went wrong in these
terms, and one mapping turns them into responses: ``portal.api.exception_handler``
for the API, ``PortalErrorMiddleware`` for the pages.

| exception   | meaning                                                     | HTTP |
| ----------- | ----------------------------------------------------------- | ---- |
| NotFound    | no such object, or one the caller may not see (never a 403) | 404  |
| NotAllowed  | the caller sees it but lacks the role for this action        | 403  |
| Conflict    | the object is in a state that forbids this action now        | 409  |
| Invalid     | bad input; names the field                                   | 400  |
| TooMany     | a per-tenant limit is reached (queued jobs); try again later | 429  |

``NotAllowed`` and ``Invalid`` are Django's ``PermissionDenied`` and
``ValidationError`` underneath, so forms and the admin treat them as usual.
"""

from django.core.exceptions import PermissionDenied, ValidationError


class NotFound(Exception):
    """No such object for this caller: another tenant's reads exactly like a missing one."""


class NotAllowed(PermissionDenied):
    """The caller may see the object but not do this to it."""


class Conflict(Exception):
    """The action does not fit the object's current state (cancel a finished job, ...)."""


class TooMany(Exception):
    """A per-tenant limit is reached for now: the same request succeeds once some work has moved on."""


class Invalid(ValidationError):
    """Bad input for one field: ``Invalid("replicas", "Use 1 to 64.")``."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__({field: message})
