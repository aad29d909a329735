"""Container image references a tenant may name: only from the registries the operator allows
(ALLOWED_IMAGE_REGISTRIES), and only well-formed. A custom job's image and an environment's workspace image
are checked here, so the two rules never drift apart."""

import re

from django.conf import settings

from common.errors import Invalid

IMAGE_REFERENCE = re.compile(r"[a-z0-9][a-z0-9._\-/:@]{0,254}")


def allowed_image(field: str, image) -> str:
    """``image`` when it is a reference from an allowed registry; else Invalid naming ``field``."""
    if not isinstance(image, str) or not image:
        raise Invalid(field, "Name the image: a reference from an allowed registry.")
    registries = settings.ALLOWED_IMAGE_REGISTRIES
    if not any(image.startswith(registry.rstrip("/") + "/") for registry in registries):
        raise Invalid(field, f"Images come from {', '.join(registries) or 'no registry (none is allowed)'}.")
    if not IMAGE_REFERENCE.fullmatch(image):
        raise Invalid(field, "Not an image reference.")
    return image
