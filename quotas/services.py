"""Writes for flavors, prices and quotas. Staff only.

A change of a tenant's quota is announced (quotas.signals.quota_changed): runners
subscribes and re-syncs the tenant's environments. The capacity a guarantee must
fit in is the flavor's ``capacity``, which runners keeps current from the inventory.
"""

from decimal import Decimal

from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction
from django.utils import timezone

from audit.services import record, snapshot
from common.errors import Invalid, NotAllowed, NotFound
from quotas.models import GuaranteeReduction, PartitionKind, PriceCard, Quota, ResourceFlavor
from quotas.selectors import guaranteed_total
from quotas.signals import quota_changed
from runners.nvidia import mig
from tenants.models import Tenant

FLAVOR_FIELDS = ["name", "kind", "gpu_model", "mig_profile", "description"]
QUOTA_FIELDS = ["guaranteed", "max", "fair_share_weight", "max_priority"]


def require_staff(actor: AbstractBaseUser) -> None:
    if not (actor.is_authenticated and actor.is_staff):
        raise NotAllowed("Only staff can change flavors, prices, quotas and partitions.")


def gpu_model_check(field: str, model: str) -> mig.GpuModel:
    """The catalog entry of a GPU model; Invalid naming `field` when NVIDIA's geometry does not know it."""
    try:
        return mig.gpu_model(model)
    except mig.UnknownGpuModelError as exc:
        raise Invalid(field, str(exc)) from None


def flavor_create(
    *, actor: AbstractBaseUser, name: str, kind: str, gpu_model: str, mig_profile: str = "", description: str = ""
) -> ResourceFlavor:
    require_staff(actor)
    model = gpu_model_check("gpu_model", gpu_model)
    if kind == PartitionKind.MIG:
        if not model.mig_capable:
            raise Invalid("gpu_model", f"{gpu_model} does not support MIG.")
        if mig_profile not in model.profiles:
            raise Invalid("mig_profile", f"{mig_profile!r} is not a MIG profile of {gpu_model}; use one of {', '.join(model.profiles)}.")
    elif mig_profile:
        raise Invalid("mig_profile", f"Only mig flavors name a MIG profile; this one is {kind}.")
    if ResourceFlavor.objects.filter(name=name).exists():
        raise Invalid("name", f"A flavor named {name!r} already exists.")
    if ResourceFlavor.objects.filter(kind=kind, gpu_model=gpu_model, mig_profile=mig_profile).exists():
        raise Invalid("kind", "A flavor for exactly this GPU model, kind and profile already exists.")
    try:
        with transaction.atomic():
            flavor = ResourceFlavor.objects.create(
                name=name, kind=kind, gpu_model=gpu_model, mig_profile=mig_profile, description=description
            )
            record("flavor.created", actor=actor, obj=flavor, after=snapshot(flavor, FLAVOR_FIELDS))
            return flavor
    except IntegrityError:
        raise Invalid("name", "A flavor with this name or shape was created at the same moment.") from None


def flavor_describe(*, actor: AbstractBaseUser, flavor: ResourceFlavor, description: str) -> ResourceFlavor:
    """Change what people read about a flavor; its name and shape stay, since quotas and prices name them."""
    require_staff(actor)
    description = description.strip()
    limit = ResourceFlavor._meta.get_field("description").max_length
    if len(description) > limit:
        raise Invalid("description", f"At most {limit} characters; this is {len(description)}.")
    with transaction.atomic():
        before = ResourceFlavor.objects.select_for_update(no_key=True).values_list("description", flat=True).get(id=flavor.id)
        ResourceFlavor.objects.filter(id=flavor.id).update(description=description)
        record("flavor.updated", actor=actor, obj=flavor, before={"description": before}, after={"description": description})
    flavor.description = description
    return flavor


def price_set(*, actor: AbstractBaseUser, flavor: ResourceFlavor, price_per_hour: Decimal, currency: str, effective_from=None) -> PriceCard:
    """Add a price card; earlier cards stay so past usage keeps its price."""
    require_staff(actor)
    effective_from = effective_from or timezone.now()
    if flavor.prices.filter(effective_from=effective_from).exists():
        raise Invalid("effective_from", "This flavor already has a price starting at that moment.")
    try:
        with transaction.atomic():
            card = PriceCard.objects.create(
                flavor=flavor, price_per_hour=price_per_hour, currency=currency.upper(), effective_from=effective_from
            )
            # A price changes by a new card from a moment on; before is the card in force until then.
            earlier = flavor.prices.filter(effective_from__lt=effective_from).exclude(id=card.id).order_by("-effective_from").first()
            fields = ["price_per_hour", "currency", "effective_from"]
            record("price.updated", actor=actor, obj=card, object_repr=f"{flavor.name}: {card.price_per_hour} {card.currency}/h",
                   before={"flavor": flavor.name, **snapshot(earlier, fields)} if earlier else None,
                   after={"flavor": flavor.name, **snapshot(card, fields)})
            return card
    except IntegrityError:
        raise Invalid("effective_from", "This flavor already has a price starting at that moment.") from None


@transaction.atomic
def quota_set(
    *,
    actor: AbstractBaseUser,
    tenant: Tenant,
    flavor: ResourceFlavor,
    guaranteed: int | None = None,
    max: int | None = None,
    fair_share_weight: Decimal | None = None,
    max_priority: int | None = None,
    must_be_new: bool = False,
) -> Quota:
    """Create or change a tenant's quota for one flavor, then resync its environments.

    A field left as None keeps its current value (or its default for a new quota);
    the merge happens under the lock, so concurrent changes of different fields all land.
    """
    require_staff(actor)
    # Lock the flavor so two concurrent changes cannot both fit under capacity; read its capacity fresh.
    flavor = ResourceFlavor.objects.select_for_update(no_key=True).get(pk=flavor.pk)
    existing = Quota.objects.filter(tenant=tenant, flavor=flavor).first()
    if must_be_new and existing is not None:
        raise Invalid("flavor", "This tenant already has a quota for this flavor; PATCH it instead.")
    current = existing or Quota()  # a new quota starts from the model's defaults
    guaranteed = current.guaranteed if guaranteed is None else guaranteed
    max = current.max if max is None else max
    fair_share_weight = current.fair_share_weight if fair_share_weight is None else fair_share_weight
    max_priority = current.max_priority if max_priority is None else max_priority
    if guaranteed > max:
        raise Invalid("guaranteed", f"guaranteed ({guaranteed}) cannot exceed max ({max}).")
    if fair_share_weight <= 0:
        raise Invalid("fair_share_weight", "The fair-share weight must be above 0.")
    capacity = flavor.capacity
    others = guaranteed_total(flavor, excluding_tenant=tenant)
    # Only a growing guarantee must fit: capacity can shrink under existing guarantees (a pool
    # cordoned or re-cut), and staff must still be able to lower them or change anything else.
    if guaranteed > current.guaranteed and others + guaranteed > capacity:
        raise Invalid("guaranteed", f"Guarantees for {flavor.name} would total {others + guaranteed} but the cluster holds {capacity}; "
                    f"at most {capacity - others if capacity > others else 0} can be guaranteed to {tenant.slug}.")
    before = snapshot(existing, QUOTA_FIELDS) if existing is not None else None
    quota, created = Quota.objects.update_or_create(
        tenant=tenant,
        flavor=flavor,
        defaults={"guaranteed": guaranteed, "max": max, "fair_share_weight": fair_share_weight, "max_priority": max_priority},
    )
    record("quota.created" if created else "quota.updated", actor=actor, tenant=tenant, obj=quota,
           object_repr=f"{tenant.slug}: {flavor.name}", before=before,
           after={"flavor": flavor.name, **snapshot(quota, QUOTA_FIELDS)})
    _announce(tenant)
    return quota


@transaction.atomic
def quota_delete(*, actor: AbstractBaseUser, quota: Quota) -> None:
    require_staff(actor)
    # Locked and read again: of two deletes at once, the second finds nothing (a 404) and records nothing.
    quota = Quota.objects.select_for_update().select_related("tenant", "flavor").filter(pk=quota.pk).first()
    if quota is None:
        raise NotFound("This quota no longer exists.")
    tenant = quota.tenant
    record("quota.deleted", actor=actor, tenant=tenant, obj=quota, object_repr=f"{tenant.slug}: {quota.flavor.name}",
           before={"flavor": quota.flavor.name, **snapshot(quota, QUOTA_FIELDS)})
    quota.delete()
    _announce(tenant)


def _announce(tenant: Tenant) -> None:
    """Tell the apps above (runners re-syncs the tenant's environments) that its quota changed."""
    quota_changed.send(sender=Quota, tenant=tenant)


def guarantees_shrink(
    *, actor: AbstractBaseUser, flavor: ResourceFlavor, capacity: int, reason: str
) -> list[GuaranteeReduction]:
    """Lower every guarantee on a flavor in proportion so that together they fit `capacity`.

    Each tenant keeps the floor of its share (guaranteed * capacity / total), so the
    sum never exceeds the capacity; every lowered guarantee is recorded with the reason.
    Call it inside the transaction of the change that shrinks the capacity.
    """
    require_staff(actor)
    ResourceFlavor.objects.select_for_update(no_key=True).get(pk=flavor.pk)
    quotas = list(Quota.objects.select_for_update().filter(flavor=flavor, guaranteed__gt=0).select_related("tenant"))
    total = sum(quota.guaranteed for quota in quotas)
    if total <= capacity:
        return []
    reductions = []
    tenants = {}
    for quota in quotas:
        after = quota.guaranteed * max(capacity, 0) // total
        if after == quota.guaranteed:
            continue
        reductions.append(
            GuaranteeReduction(
                quota=quota, tenant=quota.tenant, flavor=flavor, guaranteed_before=quota.guaranteed,
                guaranteed_after=after, reason=reason[:500], created_by=actor,
            )
        )
        Quota.objects.filter(id=quota.id).update(guaranteed=after, updated_at=timezone.now())
        record("quota.reduced", actor=actor, tenant=quota.tenant, obj=quota,
               object_repr=f"{quota.tenant.slug}: {flavor.name}", before={"guaranteed": quota.guaranteed},
               after={"guaranteed": after, "reason": reason[:500]})
        tenants[quota.tenant_id] = quota.tenant
    GuaranteeReduction.objects.bulk_create(reductions)
    for tenant in tenants.values():
        _announce(tenant)
    return reductions
