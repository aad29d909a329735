"""The API tokens page: your tokens, a new one (its secret shown once), revoke."""

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.shortcuts import redirect, render
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET, require_POST

from frontend.forms import TokenForm, add_service_errors
from tenants import selectors, services


def _render(request, form, *, created=None, secret=None, status=200):
    tokens = selectors.token_list(user=request.user)
    context = {"form": form, "tokens": tokens, "created": created, "secret": secret}
    return render(request, "frontend/tokens.html", context, status=status)


@login_required
@require_GET
def token_list(request):
    return _render(request, TokenForm())


@never_cache  # the answer holds the secret: no cache keeps it
@login_required
@require_POST
def token_create(request):
    form = TokenForm(request.POST)
    if form.is_valid():
        try:
            info, secret = services.token_create(user=request.user, **form.cleaned_data)
        except ValidationError as exc:
            add_service_errors(form, exc)
        else:
            # Rendered, not redirected: the secret is never stored, not even in a message.
            return _render(request, TokenForm(), created=info, secret=secret, status=201)
    return _render(request, form, status=400)


@login_required
@require_POST
def token_revoke(request, token_id):
    info = services.token_revoke(actor=request.user, token_id=token_id)
    messages.success(request, f"Revoked the token {info.name!r}: it no longer works.")
    return redirect("tokens")
