"""Browser forms: shape and syntax only; the services decide what is allowed."""

import json
from contextlib import contextmanager
from decimal import Decimal

from django import forms
from django.contrib.admin.forms import AdminAuthenticationForm
from django.contrib.auth.forms import AuthenticationForm
from django.core import validators
from django.core.exceptions import PermissionDenied, ValidationError
from django.template.defaultfilters import filesizeformat

from common import nulls
from frontend.drawings import parse_layout
from quotas.models import PartitionKind
from runners.clusters.models import PartitionChange
from runners.inference import services as endpoints
from runners.jobs import services as jobs
from runners.nvidia.mig import GPU_MODELS
from runners.workloads.env_policy import TRAINER_MIN_MEMORY_MIB
from tenants import login_throttle
from tenants.models import ENVIRONMENT_NAME_MAX, Role, dns_label_validator


class ThrottledLoginMixin:
    """Counts the attempt before the password is checked, and a failure after (tenants/login_throttle.py)."""

    throttled_s: int | None = None

    def clean(self):
        username = self.data.get("username")
        username = username if isinstance(username, str) else None
        wait_s = login_throttle.attempt(self.request, username)
        if wait_s is not None:
            self.throttled_s = wait_s
            raise ValidationError(login_throttle.throttled_message(wait_s), code="throttled")
        try:
            return super().clean()
        except ValidationError as error:
            if getattr(error, "code", None) == "invalid_login":
                login_throttle.failed(self.request, username)
            raise


class LoginForm(ThrottledLoginMixin, AuthenticationForm):
    pass


class AdminLoginForm(ThrottledLoginMixin, AdminAuthenticationForm):
    pass


class EnvironmentForm(forms.Form):
    name = forms.CharField(
        max_length=ENVIRONMENT_NAME_MAX,
        validators=[dns_label_validator],
        help_text=f"Lowercase letters, digits and '-', up to {ENVIRONMENT_NAME_MAX} characters.",
        widget=forms.TextInput(attrs={"placeholder": "e.g. train-llm", "autocomplete": "off"}),
    )


class MemberAddForm(forms.Form):
    username = forms.CharField(max_length=150, widget=forms.TextInput(attrs={"autocomplete": "off"}))
    role = forms.ChoiceField(choices=Role.choices, initial=Role.MEMBER)


class TokenForm(forms.Form):
    name = forms.CharField(max_length=100, help_text="What it is for, e.g. \"CI\" or \"laptop\".")
    expires_in_days = forms.IntegerField(
        label="Expires in (days)", min_value=1, max_value=365, initial=30,
        help_text="From 1 to 365 days.",
    )


def add_service_errors(form: forms.Form, error: ValidationError) -> None:
    """Put a service's ValidationError next to the fields it names; the rest go on top of the form."""
    if not hasattr(error, "error_dict"):
        form.add_error(None, error)
        return
    for field, messages in error.message_dict.items():
        # A service may name a field this form does not show (a namespace, say); say it anyway.
        form.add_error(field if field in form.fields else None, messages)


@contextmanager
def refusals_on(form: forms.Form):
    """Around a service call and what follows its success: a refusal goes on the form, never out.

    A PermissionDenied tops the form; a ValidationError goes next to the fields it names.
    """
    try:
        yield
    except PermissionDenied as exc:
        form.add_error(None, str(exc))
    except ValidationError as exc:
        add_service_errors(form, exc)


# --- Quotas and partitions (staff) --------------------------------------------

QUOTA_UNITS_MAX = 100_000


class QuotaForm(forms.Form):
    """One tenant's quota for one flavor; the service checks max and capacity."""

    tenant = nulls.ModelChoiceField(queryset=None, to_field_name="slug", empty_label="Choose a tenant")
    flavor = nulls.ModelChoiceField(queryset=None, to_field_name="name", empty_label="Choose a flavor")
    guaranteed = forms.IntegerField(min_value=0, max_value=QUOTA_UNITS_MAX, help_text="Units always available to the tenant.")
    max = forms.IntegerField(
        min_value=0, max_value=QUOTA_UNITS_MAX, label="Max", help_text="Burst ceiling, borrowed when others leave room."
    )
    fair_share_weight = forms.DecimalField(
        min_value=Decimal("0.01"), max_digits=6, decimal_places=2, initial=Decimal("1"), label="Fair-share weight"
    )
    max_priority = forms.IntegerField(min_value=0, max_value=1000, initial=100, label="Max priority")

    def __init__(self, *args, tenants, flavors, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["tenant"].queryset = tenants
        self.fields["flavor"].queryset = flavors
        self.fields["tenant"].label_from_instance = lambda tenant: f"{tenant.name} ({tenant.slug})"
        for name in ("guaranteed", "max", "fair_share_weight", "max_priority"):
            self.fields[name].widget.attrs["inputmode"] = "numeric"

    def clean(self):
        data = super().clean()
        guaranteed, most = data.get("guaranteed"), data.get("max")
        if guaranteed is not None and most is not None and guaranteed > most:
            self.add_error("guaranteed", f"guaranteed ({guaranteed}) cannot exceed max ({most}).")
        return data


def _gpu_model_choices():
    return [(name, name + ("" if model.mig_capable else " (no MIG)")) for name, model in GPU_MODELS.items()]


class PartitionPreviewForm(forms.Form):
    """The geometry of a profile: enough to draw one GPU."""

    gpu_model = forms.ChoiceField(choices=_gpu_model_choices, label="GPU model")
    kind = forms.ChoiceField(
        choices=[
            (PartitionKind.MIG, "MIG: isolated GPU instances"),
            (PartitionKind.TIMESLICE, "Time-slicing: replicas take turns"),
            (PartitionKind.WHOLE, "Whole: one workload per GPU"),
        ],
        initial=PartitionKind.MIG,
    )
    layout = forms.CharField(
        required=False,
        max_length=200,
        help_text="MIG profiles of one GPU, separated by commas or spaces, e.g. 4g.40gb, 3g.40gb.",
        widget=forms.TextInput(attrs={"placeholder": "e.g. 3g.40gb 2g.20gb 1g.10gb 1g.10gb", "autocomplete": "off"}),
    )
    replicas = forms.IntegerField(
        required=False, min_value=1, max_value=1000, help_text="Time-slicing only: how many processes share each GPU."
    )

    def clean_layout(self) -> list[str]:
        return parse_layout(self.cleaned_data["layout"])


class PartitionProfileForm(PartitionPreviewForm):
    name = forms.RegexField(
        regex=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        max_length=63,
        error_messages={"invalid": "Use lowercase letters, digits, '-' and '.'; it becomes a node label value."},
        help_text="Becomes the value of the GPU Operator's MIG config node label.",
        widget=forms.TextInput(attrs={"placeholder": "e.g. h100-4g-3g", "autocomplete": "off"}),
    )
    field_order = ["name", "gpu_model", "kind", "layout", "replicas"]


class NodePoolApplyForm(forms.Form):
    profile = nulls.ModelChoiceField(queryset=None, to_field_name="name", empty_label="Choose a profile")
    drain = forms.ChoiceField(
        choices=[
            (PartitionChange.Drain.WAIT, "Wait: refuse while work runs"),
            (PartitionChange.Drain.PREEMPT, "Preempt: checkpoint and stop running work"),
        ],
        initial=PartitionChange.Drain.WAIT,
        widget=forms.RadioSelect,
    )
    shrink_guarantees = forms.BooleanField(
        required=False,
        label="Lower guarantees that no longer fit, in proportion",
        help_text="Without this, an apply that leaves guarantees above the new capacity is refused.",
    )

    def __init__(self, *args, profiles, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["profile"].queryset = profiles


# --- Jobs --------------------------------------------------------------------------


def _name_validator(pattern: str, most: int) -> validators.RegexValidator:
    return validators.RegexValidator(
        rf"^{pattern}$", f"Lowercase letters, digits and '-', at most {most}, starting and ending alphanumeric."
    )


def _job_bound(field: str) -> dict:
    low, high = jobs.BOUNDS[field]
    return {"min_value": low, "max_value": high}


JOB_TEMPLATES = [
    ("pytorch-ddp", "The portal's trainer (a small language model, PyTorch DDP)"),
    ("script", "My own script, from one of the tenant's bundles"),
]


def command_lines(text: str) -> list[str]:
    """A command typed one argument per line: each line is one argument as it stands (spaces around it dropped,
    blank lines skipped). No quoting and no shell: what is typed is what the script's argv holds."""
    return [line.strip() for line in text.splitlines() if line.strip()]


def bundle_label(bundle) -> str:
    """How the bundle picker shows one bundle: its digest's start, what it holds, when it came."""
    files = f"{bundle.files} file{'' if bundle.files == 1 else 's'}"
    return (f"{bundle.sha256[:12]} · {files}, {filesizeformat(bundle.unpacked_bytes)} · "
            f"uploaded {bundle.created_at:%Y-%m-%d %H:%M}")


class JobForm(forms.Form):
    """The submit form: the API's fields, the flavor offered only where the tenant has quota.

    The form checks every field's shape itself, so one submit shows every such error at once:
    the service stops at the first bad field, and is asked only once the form is valid. What
    depends on the quota and the cluster is still the service's to say. A script job also names
    one of the tenant's bundles (newest first) and its command, one argument per line.
    """

    template = forms.ChoiceField(choices=JOB_TEMPLATES, required=False, initial="pytorch-ddp", label="What it runs",
                                 widget=forms.RadioSelect)
    bundle = forms.ChoiceField(choices=(), required=False, initial="", label="Bundle",
                               help_text="Script jobs: the code it runs (a project folder uploaded by portal run, or through the API).")
    command = forms.CharField(
        required=False, initial="", label="Command", max_length=jobs.COMMAND_MAX_CHARS + jobs.COMMAND_MAX_ARGS,
        widget=forms.Textarea(attrs={"rows": 4, "spellcheck": "false", "autocomplete": "off",
                                     "placeholder": "python\ntrain.py\n--epochs\n3"}),
        help_text="Script jobs: one argument per line, run in the bundle's folder as typed (no shell, no quoting).",
    )
    hyperparameters = forms.CharField(
        required=False, initial="", label="Hyperparameters (JSON)",
        max_length=jobs.SCRIPT_HYPERPARAMETERS_MAX_BYTES,
        widget=forms.Textarea(attrs={"rows": 3, "spellcheck": "false", "placeholder": '{"lr": 0.001}'}),
        help_text="Script jobs: a JSON object the script reads as PORTAL_HYPERPARAMETERS.",
    )
    environment = forms.TypedChoiceField(coerce=int, choices=())
    name = forms.CharField(max_length=jobs.NAME_MAX, validators=[_name_validator(jobs.NAME_PATTERN, jobs.NAME_MAX)],
                           help_text="Lowercase letters, digits and '-'.")
    flavor = forms.ChoiceField(choices=())
    replicas = forms.IntegerField(initial=2, **_job_bound("replicas"))
    gpus_per_replica = forms.IntegerField(initial=1, label="GPUs per replica", **_job_bound("gpus_per_replica"),
                                          help_text="Whole GPUs; 1 for a MIG slice or a time-slice share.")
    cpu_milli_per_replica = forms.IntegerField(initial=2000, label="CPU per replica (millicores)",
                                               **_job_bound("cpu_milli_per_replica"))
    memory_mib_per_replica = forms.IntegerField(initial=4096, label="Memory per replica (MiB)",
                                                **_job_bound("memory_mib_per_replica"),
                                                help_text=f"At least {TRAINER_MIN_MEMORY_MIB} for the portal's trainer.")
    topology_level = forms.ChoiceField(
        label="Keep replicas together", initial="node",
        choices=[("none", "Anywhere"), ("node", "On one node"), ("nvlink", "In one NVLink domain"), ("rack", "In one rack")],
    )
    topology_mode = forms.ChoiceField(label="Topology is", initial="required",
                                      choices=[("required", "Required"), ("preferred", "Preferred")])
    priority = forms.IntegerField(initial=0, **_job_bound("priority"))
    preemptible = forms.BooleanField(required=False, initial=True, label="Preemptible (may borrow idle GPUs)")
    steps = forms.IntegerField(initial=200, **_job_bound("steps"))
    checkpoint_every_steps = forms.IntegerField(initial=20, label="Checkpoint every (steps)",
                                                **_job_bound("checkpoint_every_steps"))
    max_runtime_s = forms.IntegerField(initial=3600, label="Maximum runtime (s)", **_job_bound("max_runtime_s"))
    max_retries = forms.IntegerField(initial=3, **_job_bound("max_retries"))

    def __init__(self, *args, environments, flavors, bundles=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["environment"].choices = [(e.id, e.name) for e in environments]
        self.fields["flavor"].choices = [(row["name"], row["label"]) for row in flavors]
        self.fields["bundle"].choices = [("", "Choose a bundle")] + [(b.sha256, bundle_label(b)) for b in bundles]

    def clean(self):
        # Add each error and go on: bailing out at the first would hide the rest until the next submit.
        data = super().clean()
        steps, every = data.get("steps"), data.get("checkpoint_every_steps")
        if steps is not None and every is not None and every > steps:
            self.add_error("checkpoint_every_steps", f"Must be between 0 and {steps}, got {every}.")
        data["template"] = data.get("template") or "pytorch-ddp"
        if data["template"] == "script":
            self._clean_script(data)
        elif (data.get("memory_mib_per_replica") or TRAINER_MIN_MEMORY_MIB) < TRAINER_MIN_MEMORY_MIB:
            self.add_error("memory_mib_per_replica", f"At least {TRAINER_MIN_MEMORY_MIB} for the portal's trainer.")
        return data

    def _clean_script(self, data: dict) -> None:
        if not data.get("bundle"):
            self.add_error("bundle", "Choose the bundle the script is in.")
        data["command"] = command_lines(data.get("command") or "")
        if not data["command"]:
            self.add_error("command", "Give the command, one argument per line (e.g. python, then train.py).")
        text = (data.get("hyperparameters") or "").strip()
        try:
            data["hyperparameters"] = json.loads(text) if text else {}
        except ValueError as exc:
            self.add_error("hyperparameters", f"Not JSON: {exc}.")
            return
        if not isinstance(data["hyperparameters"], dict):
            self.add_error("hyperparameters", 'A JSON object, e.g. {"lr": 0.001}.')

    def job_data(self, tenant_slug: str) -> dict:
        data = dict(self.cleaned_data)
        data["topology"] = {"level": data.pop("topology_level"), "mode": data.pop("topology_mode")}
        if data["template"] != "script":
            # The trainer's form sends none of a script's fields (what was typed there is not for it).
            for field in ("bundle", "command", "hyperparameters"):
                data.pop(field)
        return {"tenant": tenant_slug, **data}

    def add_job_errors(self, error: ValidationError) -> None:
        renamed = {"topology.level": "topology_level", "topology.mode": "topology_mode"}
        for field, messages in error.message_dict.items():
            field = renamed.get(field, field)
            self.add_error(field if field in self.fields else None, messages)


# --- Inference endpoints --------------------------------------------------------------

# Where the endpoint services name a field of the source, and which form field shows it.
SOURCE_ERROR_FIELDS = {"source": "job", "source.job": "job", "source.step": "step", "source.image": "job"}


def _add_endpoint_errors(form: forms.Form, error: ValidationError) -> None:
    if not hasattr(error, "error_dict"):
        form.add_error(None, error)
        return
    for field, messages in error.message_dict.items():
        field = SOURCE_ERROR_FIELDS.get(field, field)
        form.add_error(field if field in form.fields else None, messages)


class _SourceFields(forms.Form):
    """A checkpoint of one of the tenant's training jobs: the job, and a step (its newest unless given)."""

    job = forms.TypedChoiceField(coerce=int, choices=(), label="Source job",
                                 help_text="A training job of this tenant; its checkpoint is served.")
    step = forms.IntegerField(required=False, min_value=0, label="Checkpoint step",
                              help_text="Leave empty for the job's newest checkpoint.")

    def __init__(self, *args, source_jobs, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["job"].choices = [(job["id"], job["label"]) for job in source_jobs]

    def source(self) -> dict:
        source = {"job": self.cleaned_data["job"]}
        if self.cleaned_data.get("step") is not None:
            source["step"] = self.cleaned_data["step"]
        return source

    add_endpoint_errors = _add_endpoint_errors


ENDPOINT_NUMBERS = {
    # field: (label, help text); the bounds and defaults are the service's own.
    "gpus_per_replica": ("GPUs per replica", "Whole GPUs; 1 for a MIG slice or a time-slice share."),
    "min_replicas": ("Min replicas", "Never preempted: min replicas x GPUs per replica must fit the guarantee."),
    "max_replicas": ("Max replicas", "The autoscaler adds replicas up to this under load."),
    "warm_replicas": ("Warm replicas", "Kept ready beyond what the load needs."),
    "queue_limit": ("Queue limit", "Requests a replica admits beyond its running batch; past it, 429."),
    "batch_token_budget": ("Batch token budget", "Prompt bytes plus max_tokens of a replica's running batch, at most."),
    "max_batch_wait_ms": ("Max batch wait (ms)", "How long waiting requests are gathered to join the batch."),
    "default_deadline_ms": ("Default deadline (ms)", "For requests that give no deadline_ms."),
}


def _number_field(field: str, bounds: dict, *, required: bool = True) -> forms.IntegerField:
    label, help_text = ENDPOINT_NUMBERS[field]
    low, high, default = bounds[field]
    return forms.IntegerField(label=label, initial=default, required=required,
                              help_text=f"{help_text} From {low} to {high}.",
                              widget=forms.NumberInput(attrs={"inputmode": "numeric"}))


class EndpointForm(_SourceFields):
    """The deploy form: the API's fields; the service checks them and names the field it refuses."""

    environment = forms.TypedChoiceField(coerce=int, choices=())
    name = forms.CharField(help_text="Lowercase letters, digits and '-'; the URL ends with it.",
                           widget=forms.TextInput(attrs={"autocomplete": "off"}))
    flavor = forms.ChoiceField(choices=())

    field_order = ["name", "environment", "job", "step", "flavor"]

    def __init__(self, *args, environments, flavors, source_jobs, bounds, name_max, **kwargs):
        super().__init__(*args, source_jobs=source_jobs, **kwargs)
        self.fields["environment"].choices = [(e.id, e.name) for e in environments]
        self.fields["flavor"].choices = [(row["name"], row["label"]) for row in flavors]
        self.fields["name"].max_length = name_max
        self.fields["name"].widget.attrs["maxlength"] = str(name_max)
        self.fields["name"].validators += [
            validators.MaxLengthValidator(name_max), _name_validator(endpoints.NAME_PATTERN, endpoints.NAME_MAX)]
        for field in ENDPOINT_NUMBERS:
            self.fields[field] = _number_field(field, bounds)

    def clean(self):
        return _replica_range_clean(self, super().clean())

    def endpoint_data(self, tenant_slug: str) -> dict:
        data = {"tenant": tenant_slug, "environment": self.cleaned_data["environment"],
                "name": self.cleaned_data["name"], "source": self.source(), "flavor": self.cleaned_data["flavor"]}
        data.update({field: self.cleaned_data[field] for field in ENDPOINT_NUMBERS})
        return data


def _replica_range_clean(form: forms.Form, data: dict) -> dict:
    """min <= max and warm <= max, in the service's words; each error added, none stopping the rest."""
    low, high, warm = (data.get(field) for field in ("min_replicas", "max_replicas", "warm_replicas"))
    if low is not None and high is not None and (high < low or high < 1):
        form.add_error("max_replicas", f"At least min_replicas ({low}) and at least 1.")
    if warm is not None and high is not None and warm > high:
        form.add_error("warm_replicas", f"At most max_replicas ({high}).")
    return data


class EndpointScaleForm(forms.Form):
    """Min, max and warm replicas: the autoscaler moves within them."""

    def __init__(self, *args, bounds, **kwargs):
        super().__init__(*args, **kwargs)
        for field in ("min_replicas", "max_replicas", "warm_replicas"):
            self.fields[field] = _number_field(field, bounds)

    def clean(self):
        return _replica_range_clean(self, super().clean())

    add_endpoint_errors = _add_endpoint_errors


class EndpointRolloutForm(_SourceFields):
    """Serve another checkpoint: a new generation replaces the replicas one at a time."""
