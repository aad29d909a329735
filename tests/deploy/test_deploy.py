"""The portal's own deployment: the Kustomize manifests in deploy/ and the Dockerfile.

The manifests are rendered the way an operator renders them (`make deploy-render`, kubectl's
built-in kustomize) and then checked for what a reviewer would otherwise check by eye:

- every object is valid for Kubernetes 1.30 and for the newest schema kubernetes-validate has;
- every pod template meets Pod Security "restricted" (`pss_violations`, itself shown to catch
  each violation on a deliberately bad pod) and has a read-only root filesystem, resources, and
  (web) probes that work with DEBUG off;
- secrets are referenced, never embedded;
- RBAC is least privilege: no wildcards, no binding to the built-in admin roles, and the
  ClusterRole's rules are exactly EXPECTED_CLUSTER_ROLE_RULES, so widening it fails here; and
  every call the Kubernetes backend makes (read from runners/backends/kubernetes.py) is granted,
  and nothing it does not make.

No database: nothing here uses the db fixture. Without kubectl the rendering tests are skipped
(.ci/run installs it).
"""

from __future__ import annotations

import ast
import copy
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = ("default", "production")
# The oldest Kubernetes the manifests promise to work on, and the newest schema available.
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")
PORTAL_NAMESPACE = "gpu-portal"
SERVICE_ACCOUNT = "gpu-portal"
SECRET_NAME = "gpu-portal-secrets"
# Settings that hold credentials: they may reach a pod only through a secretKeyRef.
SECRET_SETTINGS = {"SECRET_KEY", "DATABASE_URL", "MIGRATE_DATABASE_URL", "CELERY_BROKER_URL", "CACHE_URL",
                   "METRICS_SCRAPE_TOKEN", "SENTRY_DSN"}
REQUIRED_SECRET_KEYS = {"SECRET_KEY", "DATABASE_URL", "MIGRATE_DATABASE_URL", "CELERY_BROKER_URL", "CACHE_URL"}

# The ClusterRole, rule by rule: (apiGroups, resources, verbs, resourceNames). A change to the
# ClusterRole has to change this too, in the same review.
EXPECTED_CLUSTER_ROLE_RULES = {
    (("",), ("namespaces",), ("create", "delete", "get", "patch"), ()),
    (("",), ("limitranges", "resourcequotas", "serviceaccounts", "services"), ("create", "delete", "list", "patch"), ()),
    (("networking.k8s.io",), ("networkpolicies",), ("create", "delete", "list", "patch"), ()),
    (("",), ("persistentvolumeclaims",), ("create", "delete", "get", "list", "patch"), ()),
    (("",), ("secrets",), ("create", "delete"), ()),
    (("batch",), ("jobs",), ("create", "delete", "get", "list", "patch"), ()),
    (("apps",), ("deployments",), ("create", "delete", "get", "list", "patch"), ()),
    (("apps",), ("replicasets",), ("delete", "list"), ()),
    (("policy",), ("poddisruptionbudgets",), ("create", "delete", "patch"), ()),
    (("",), ("pods",), ("delete", "list", "watch"), ()),
    (("",), ("pods/log",), ("get",), ()),
    (("",), ("pods/binding", "pods/eviction"), ("create",), ()),
    (("",), ("events",), ("list",), ()),
    (("",), ("nodes",), ("get", "list", "patch"), ()),
    (("rbac.authorization.k8s.io",), ("roles",), ("list",), ()),
    (("rbac.authorization.k8s.io",), ("roles",), ("bind", "create", "delete", "escalate", "patch"),
     ("portal-editor", "portal-viewer")),
    (("rbac.authorization.k8s.io",), ("rolebindings",), ("create", "delete", "list", "patch"), ()),
}
# The namespaced Roles: namespace -> rules, the same shape.
EXPECTED_ROLE_RULES = {
    "gpu-portal-members": {
        (("",), ("serviceaccounts",), ("get",), ()),
        (("",), ("serviceaccounts/token",), ("create",), ()),
    },
    "gpu-operator": {
        (("",), ("configmaps",), ("get", "update"), ("portal-device-plugin-config", "portal-mig-parted-config")),
        (("",), ("configmaps",), ("create",), ()),
    },
}
BUILT_IN_ROLES = {"cluster-admin", "admin", "edit", "system:masters"}

POD_TEMPLATE_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}


# --- Rendering ---------------------------------------------------------------------------


def _kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.skip("kubectl is not installed: its built-in kustomize renders deploy/ (.ci/run installs it)")
    return path


def _documents(text: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    """Overlay name -> the objects `kubectl kustomize` renders for it."""
    kubectl = _kubectl()
    result = {}
    for overlay in OVERLAYS:
        out = subprocess.run([kubectl, "kustomize", str(ROOT / "deploy" / "overlays" / overlay)],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, f"kubectl kustomize deploy/overlays/{overlay} failed:\n{out.stderr}"
        result[overlay] = _documents(out.stdout)
    return result


def _all(rendered: dict[str, list[dict]]):
    for overlay, objects in rendered.items():
        for obj in objects:
            yield overlay, obj


def _named(objects: list[dict], kind: str, name: str, namespace: str | None = None) -> dict:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name
             and (namespace is None or o["metadata"].get("namespace") == namespace)]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def _config_map(objects: list[dict]) -> dict:
    maps = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("gpu-portal-config")]
    assert len(maps) == 1
    return maps[0]


def _pod_templates(objects: list[dict]):
    for obj in objects:
        if obj["kind"] in POD_TEMPLATE_KINDS:
            yield obj, obj["spec"]["template"]["spec"]
        elif obj["kind"] == "CronJob":
            yield obj, obj["spec"]["jobTemplate"]["spec"]["template"]["spec"]
        elif obj["kind"] == "Pod":
            yield obj, obj["spec"]


def _containers(pod_spec: dict) -> list[dict]:
    return [*pod_spec.get("initContainers", []), *pod_spec.get("containers", []),
            *pod_spec.get("ephemeralContainers", [])]


def test_make_deploy_render_prints_the_default_overlay(rendered):
    out = subprocess.run(["make", "-s", "--no-print-directory", "deploy-render"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert _documents(out.stdout) == rendered["default"]


def test_both_overlays_render_the_same_kinds_of_objects(rendered):
    kinds = {overlay: sorted((o["kind"], o["metadata"]["name"].split("-config-")[0]) for o in objects)
             for overlay, objects in rendered.items()}
    assert kinds["default"] == kinds["production"]
    expected = {"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
                "ConfigMap", "Deployment", "Job", "Service", "Ingress", "HorizontalPodAutoscaler",
                "PodDisruptionBudget", "NetworkPolicy"}
    assert {kind for kind, _ in kinds["default"]} == expected


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_is_valid_kubernetes(rendered, version):
    for overlay, obj in _all(rendered):
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{overlay}: {obj['kind']} {obj['metadata']['name']} is not valid for {version}: "
                        f"{'.'.join(map(str, exc.path))}: {exc.message}")


# --- Pod Security "restricted" ---------------------------------------------------------------

# https://kubernetes.io/docs/concepts/security/pod-security-standards/ (restricted, which includes baseline).
ALLOWED_VOLUME_TYPES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                        "projected", "secret"}
ALLOWED_ADDED_CAPABILITIES = {"NET_BIND_SERVICE"}
ALLOWED_SECCOMP = {"RuntimeDefault", "Localhost"}
ALLOWED_SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}


def pss_violations(pod_spec: dict) -> list[str]:
    """What in this pod spec the Pod Security "restricted" profile (baseline included) refuses; empty if nothing."""
    problems = []
    pod_context = pod_spec.get("securityContext") or {}
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod_spec.get(field):
            problems.append(f"{field} is true")
    for volume in pod_spec.get("volumes") or []:
        for volume_type in set(volume) - {"name"}:
            if volume_type not in ALLOWED_VOLUME_TYPES:
                problems.append(f"volume {volume['name']} is of type {volume_type}")
    for sysctl in pod_context.get("sysctls") or []:
        if sysctl["name"] not in SAFE_SYSCTLS:
            problems.append(f"sysctl {sysctl['name']} is not a safe one")
    if (pod_context.get("windowsOptions") or {}).get("hostProcess"):
        problems.append("the pod is a Windows host process")
    if pod_context.get("runAsUser") == 0:
        problems.append("the pod runs as UID 0")
    if (pod_context.get("appArmorProfile") or {}).get("type") == "Unconfined":
        problems.append("the pod's AppArmor profile is Unconfined")
    problems += _selinux_problems("the pod", pod_context.get("seLinuxOptions"))
    pod_seccomp = (pod_context.get("seccompProfile") or {}).get("type")
    if pod_seccomp is not None and pod_seccomp not in ALLOWED_SECCOMP:
        problems.append(f"the pod's seccomp profile is {pod_seccomp}")
    for container in _containers(pod_spec):
        name = f"container {container['name']}"
        context = container.get("securityContext") or {}
        if context.get("privileged"):
            problems.append(f"{name} is privileged")
        if context.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{name} does not set allowPrivilegeEscalation: false")
        capabilities = context.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            problems.append(f"{name} does not drop ALL capabilities")
        for added in set(capabilities.get("add") or []) - ALLOWED_ADDED_CAPABILITIES:
            problems.append(f"{name} adds capability {added}")
        run_as_non_root = context.get("runAsNonRoot", pod_context.get("runAsNonRoot"))
        if run_as_non_root is not True:
            problems.append(f"{name} does not run as non-root (runAsNonRoot)")
        if context.get("runAsUser") == 0:
            problems.append(f"{name} runs as UID 0")
        seccomp = (context.get("seccompProfile") or {}).get("type", pod_seccomp)
        if seccomp not in ALLOWED_SECCOMP:
            problems.append(f"{name} has seccomp profile {seccomp or 'unset'}")
        if (context.get("windowsOptions") or {}).get("hostProcess"):
            problems.append(f"{name} is a Windows host process")
        if context.get("procMount", "Default") != "Default":
            problems.append(f"{name} has procMount {context['procMount']}")
        if (context.get("appArmorProfile") or {}).get("type") == "Unconfined":
            problems.append(f"{name}'s AppArmor profile is Unconfined")
        problems += _selinux_problems(name, context.get("seLinuxOptions"))
        for port in container.get("ports") or []:
            if port.get("hostPort"):
                problems.append(f"{name} uses host port {port['hostPort']}")
    return problems


def _selinux_problems(who: str, options: dict | None) -> list[str]:
    options = options or {}
    problems = []
    if options.get("type", "") not in ALLOWED_SELINUX_TYPES:
        problems.append(f"{who} sets SELinux type {options['type']}")
    for field in ("user", "role"):
        if options.get(field):
            problems.append(f"{who} sets SELinux {field}")
    return problems


GOOD_POD = {
    "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "seccompProfile": {"type": "RuntimeDefault"}},
    "containers": [{
        "name": "app",
        "image": "example",
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                            "readOnlyRootFilesystem": True},
    }],
    "volumes": [{"name": "tmp", "emptyDir": {}}],
}


def _bad(change) -> dict:
    pod = copy.deepcopy(GOOD_POD)
    change(pod)
    return pod


def _container_context(pod: dict) -> dict:
    return pod["containers"][0]["securityContext"]


BAD_PODS = {
    "hostNetwork": lambda p: p.update(hostNetwork=True),
    "hostPID": lambda p: p.update(hostPID=True),
    "hostIPC": lambda p: p.update(hostIPC=True),
    "hostPath volume": lambda p: p["volumes"].append({"name": "root", "hostPath": {"path": "/"}}),
    "nfs volume": lambda p: p["volumes"].append({"name": "share", "nfs": {"server": "x", "path": "/"}}),
    "privileged": lambda p: _container_context(p).update(privileged=True),
    "escalation allowed": lambda p: _container_context(p).update(allowPrivilegeEscalation=True),
    "escalation unset": lambda p: _container_context(p).pop("allowPrivilegeEscalation"),
    "capabilities kept": lambda p: _container_context(p).update(capabilities={"drop": ["NET_RAW"]}),
    "capability added": lambda p: _container_context(p)["capabilities"].update(add=["SYS_ADMIN"]),
    "root allowed": lambda p: p["securityContext"].pop("runAsNonRoot"),
    "container may be root": lambda p: _container_context(p).update(runAsNonRoot=False),
    "uid 0": lambda p: _container_context(p).update(runAsUser=0),
    "no seccomp": lambda p: p["securityContext"].pop("seccompProfile"),
    "unconfined seccomp": lambda p: _container_context(p).update(seccompProfile={"type": "Unconfined"}),
    "host port": lambda p: p["containers"][0].update(ports=[{"containerPort": 80, "hostPort": 80}]),
    "unsafe sysctl": lambda p: p["securityContext"].update(sysctls=[{"name": "kernel.msgmax", "value": "1"}]),
    "unmasked proc": lambda p: _container_context(p).update(procMount="Unmasked"),
    "init container as root": lambda p: p.update(initContainers=[{"name": "init", "image": "x", "securityContext": {
        "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "runAsUser": 0}}]),
}


def test_pss_violations_passes_a_restricted_pod():
    assert pss_violations(GOOD_POD) == []


@pytest.mark.parametrize("case", sorted(BAD_PODS))
def test_pss_violations_catches(case):
    assert pss_violations(_bad(BAD_PODS[case])), f"{case} was not caught"


def test_every_pod_template_meets_pod_security_restricted(rendered):
    templates = 0
    for overlay, objects in rendered.items():
        for obj, pod_spec in _pod_templates(objects):
            templates += 1
            assert pss_violations(pod_spec) == [], f"{overlay}: {obj['kind']} {obj['metadata']['name']}"
    assert templates == 2 * 5  # web, edge, worker, beat, migrate in each overlay


def test_every_container_has_a_read_only_root_filesystem_and_the_image_user(rendered):
    for _overlay, objects in rendered.items():
        for obj, pod_spec in _pod_templates(objects):
            assert pod_spec["securityContext"]["runAsUser"] == 10001, obj["metadata"]["name"]
            for container in _containers(pod_spec):
                assert container["securityContext"]["readOnlyRootFilesystem"] is True, container["name"]
                mounts = {mount["mountPath"] for mount in container.get("volumeMounts", [])}
                # The only writable places: /tmp and PORTAL_VAR_DIR (settings.py creates it on import).
                assert {"/tmp", "/var/lib/gpu-portal"} <= mounts, container["name"]
            assert all("emptyDir" in volume for volume in pod_spec["volumes"])


def test_the_portal_namespaces_enforce_restricted(rendered):
    for _overlay, objects in rendered.items():
        namespaces = [o for o in objects if o["kind"] == "Namespace"]
        assert PORTAL_NAMESPACE in {n["metadata"]["name"] for n in namespaces}
        for namespace in namespaces:
            assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


def test_every_container_has_requests_and_limits(rendered):
    for _overlay, objects in rendered.items():
        for _obj, pod_spec in _pod_templates(objects):
            for container in _containers(pod_spec):
                for bound in ("requests", "limits"):
                    assert {"cpu", "memory"} <= set(container["resources"][bound]), (container["name"], bound)


def test_web_probes_pass_django_with_debug_off(rendered):
    objects = rendered["default"]
    web = _named(objects, "Deployment", "gpu-portal-web")["spec"]["template"]["spec"]["containers"][0]
    assert web["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert web["livenessProbe"]["httpGet"]["path"] == "/healthz"
    allowed_hosts = _config_map(objects)["data"]["ALLOWED_HOSTS"].split(",")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        headers = {h["name"]: h["value"] for h in web[probe]["httpGet"]["httpHeaders"]}
        # Otherwise SECURE_SSL_REDIRECT answers 301 and ALLOWED_HOSTS refuses the pod's IP.
        assert headers["X-Forwarded-Proto"] == "https"
        assert headers["Host"] in allowed_hosts


def test_web_is_autoscaled_and_protected_from_disruption(rendered):
    for _overlay, objects in rendered.items():
        web = _named(objects, "Deployment", "gpu-portal-web")
        assert "replicas" not in web["spec"], "the HorizontalPodAutoscaler sets the web replicas"
        hpa = _named(objects, "HorizontalPodAutoscaler", "gpu-portal-web")
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "gpu-portal-web"}
        assert hpa["spec"]["minReplicas"] >= 2
        pdb = _named(objects, "PodDisruptionBudget", "gpu-portal-web")
        assert pdb["spec"]["minAvailable"] < hpa["spec"]["minReplicas"]
        labels = web["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert (_named(rendered["production"], "HorizontalPodAutoscaler", "gpu-portal-web")["spec"]["minReplicas"]
            > _named(rendered["default"], "HorizontalPodAutoscaler", "gpu-portal-web")["spec"]["minReplicas"])


def test_one_beat_and_the_commands(rendered):
    for _overlay, objects in rendered.items():
        beat = _named(objects, "Deployment", "gpu-portal-beat")
        assert beat["spec"]["replicas"] == 1 and beat["spec"]["strategy"] == {"type": "Recreate"}
        commands = {o["metadata"]["name"]: o["spec"]["template"]["spec"]["containers"][0]["command"]
                    for o in objects if o["kind"] in ("Deployment", "Job")}
        assert commands["gpu-portal-web"][:3] == ["gunicorn", "--config", "python:portal.gunicorn_conf"]
        assert commands["gpu-portal-edge"][:3] == ["python", "-m", "runners.edge"]
        assert commands["gpu-portal-worker"][:4] == ["celery", "-A", "portal", "worker"]
        assert commands["gpu-portal-beat"][:4] == ["celery", "-A", "portal", "beat"]
        assert commands["gpu-portal-migrate"] == ["python", "manage.py", "migrate", "--noinput"]
    assert (ROOT / "portal" / "gunicorn_conf.py").is_file()


def test_only_pods_that_call_the_api_mount_a_token(rendered):
    objects = rendered["default"]
    assert _named(objects, "ServiceAccount", SERVICE_ACCOUNT)["automountServiceAccountToken"] is False
    mounts = {obj["metadata"]["name"]: pod_spec.get("automountServiceAccountToken", False)
              for obj, pod_spec in _pod_templates(objects)}
    assert mounts == {"gpu-portal-web": True, "gpu-portal-worker": True, "gpu-portal-beat": False,
                      "gpu-portal-migrate": False, "gpu-portal-edge": False}


def test_images_are_the_portal_s_and_pinned_in_production(rendered):
    for overlay, objects in rendered.items():
        images = {c["image"] for _obj, pod in _pod_templates(objects) for c in _containers(pod)}
        assert len(images) == 1, images
        image = images.pop()
        # Training and inference pods run the portal's own image too.
        assert _config_map(objects)["data"]["KUBERNETES_TRAINER_IMAGE"] == image
        if overlay == "production":
            assert not image.endswith(":latest") and re.search(r":\d+\.\d+\.\d+$|@sha256:[0-9a-f]{64}$", image)


# --- Secrets and configuration ----------------------------------------------------------------


def test_secrets_are_referenced_never_embedded(rendered):
    referenced = set()
    for overlay, obj in _all(rendered):
        assert obj["kind"] != "Secret", f"{overlay} renders a Secret; create it with kubectl instead (deploy/README.md)"
    for _overlay, objects in rendered.items():
        assert not SECRET_SETTINGS & set(_config_map(objects)["data"])
        for _obj, pod_spec in _pod_templates(objects):
            for container in _containers(pod_spec):
                for variable in container.get("env", []):
                    if variable["name"] in SECRET_SETTINGS:
                        assert "value" not in variable, variable["name"]
                        ref = variable["valueFrom"]["secretKeyRef"]
                        assert ref["name"] == SECRET_NAME and ref["key"] == variable["name"]
                        if not ref.get("optional"):
                            referenced.add(ref["key"])
    assert referenced == REQUIRED_SECRET_KEYS


def _settings_read() -> set[str]:
    """Every variable portal/settings.py and portal/gunicorn_conf.py read."""
    names = {"DJANGO_SETTINGS_MODULE"}
    for path in ("portal/settings.py", "portal/gunicorn_conf.py"):
        names |= set(re.findall(r"env_\w+\(\s*\"([A-Z][A-Z0-9_]*)\"", (ROOT / path).read_text()))
    return names


def test_config_map_sets_only_settings_that_exist(rendered):
    known = _settings_read()
    for _overlay, objects in rendered.items():
        data = _config_map(objects)["data"]
        assert set(data) <= known, f"not read by the portal: {sorted(set(data) - known)}"
        assert data["DEBUG"] == "false"
        assert data["CLUSTER_BACKEND"] == "kubernetes" and data["KUBERNETES_IN_CLUSTER"] == "true"


def test_config_map_agrees_with_the_manifests(rendered):
    for _overlay, objects in rendered.items():
        data = _config_map(objects)["data"]
        assert data["KUBERNETES_PORTAL_NAMESPACE"] == PORTAL_NAMESPACE
        assert {o["metadata"].get("namespace") for o in objects if o["kind"] in POD_TEMPLATE_KINDS} == {PORTAL_NAMESPACE}
        assert _named(objects, "Role", "gpu-portal-member-tokens")["metadata"]["namespace"] == \
            data["KUBERNETES_MEMBER_ACCOUNTS_NAMESPACE"]
        partitions = _named(objects, "Role", "gpu-portal-partitions")
        assert partitions["metadata"]["namespace"] == data["KUBERNETES_GPU_OPERATOR_NAMESPACE"]
        named = [rule for rule in partitions["rules"] if rule.get("resourceNames")]
        assert set(named[0]["resourceNames"]) == {data["KUBERNETES_MIG_PARTED_CONFIG_MAP"],
                                                  data["KUBERNETES_DEVICE_PLUGIN_CONFIG_MAP"]}
        assert data["PORTAL_VAR_DIR"] == "/var/lib/gpu-portal"


# --- Network policies -----------------------------------------------------------------------


def test_ingress_is_denied_by_default_and_web_takes_the_ingress_controller(rendered):
    objects = rendered["default"]
    policies = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "NetworkPolicy"}
    deny = policies["default-deny"]
    assert deny["podSelector"] == {} and "Ingress" in deny["policyTypes"] and not deny.get("ingress")
    ingress_rules = [(name, spec) for name, spec in policies.items() if spec.get("ingress")]
    assert sorted(name for name, _ in ingress_rules) == ["allow-ingress-controller-to-edge",
                                                         "allow-ingress-controller-to-web"]
    for (_, spec), component in zip(sorted(ingress_rules), ("edge", "web"), strict=True):
        assert spec["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == component
        assert spec["ingress"][0]["ports"] == [{"protocol": "TCP", "port": 8000}]
    egress_ports = {port["port"] for spec in policies.values() for rule in spec.get("egress", [])
                    for port in rule.get("ports", [])}
    assert {53, 5432, 6379, 443, 6443} <= egress_ports


# --- RBAC -------------------------------------------------------------------------------------


def _rule_key(rule: dict) -> tuple:
    return (tuple(sorted(rule.get("apiGroups", []))), tuple(sorted(rule.get("resources", []))),
            tuple(sorted(rule.get("verbs", []))), tuple(sorted(rule.get("resourceNames", []))))


def rbac_problems(objects: list[dict]) -> list[str]:
    """Wildcards, dangerous verbs and bindings to the built-in admin roles in these RBAC objects."""
    problems = []
    for obj in objects:
        name = f"{obj['kind']} {obj['metadata']['name']}"
        if obj["kind"] in ("Role", "ClusterRole"):
            if obj.get("aggregationRule"):
                problems.append(f"{name} aggregates other roles")
            for rule in obj.get("rules") or []:
                for field in ("apiGroups", "resources", "verbs", "resourceNames"):
                    if any("*" in value for value in rule.get(field, [])):
                        problems.append(f"{name} has a wildcard in {field}")
                if "nonResourceURLs" in rule:
                    problems.append(f"{name} grants nonResourceURLs")
                for verb in {"impersonate", "deletecollection"} & set(rule.get("verbs", [])):
                    problems.append(f"{name} grants {verb}")
                # Secrets may be made and removed (a workspace attempt's key), never read or changed.
                if {"secrets"} & set(rule.get("resources", [])) and set(rule.get("verbs", [])) - {"create", "delete"}:
                    problems.append(f"{name} grants access to Secrets")
        if obj["kind"] in ("RoleBinding", "ClusterRoleBinding") and obj["roleRef"]["name"] in BUILT_IN_ROLES:
            problems.append(f"{name} binds {obj['roleRef']['name']}")
    return problems


def test_no_wildcards_and_no_built_in_admin_roles(rendered):
    for overlay, objects in rendered.items():
        assert rbac_problems(objects) == [], overlay
        for binding in (o for o in objects if o["kind"] in ("RoleBinding", "ClusterRoleBinding")):
            assert binding["roleRef"]["name"].startswith("gpu-portal")


@pytest.mark.parametrize("bad", [
    {"kind": "ClusterRole", "metadata": {"name": "x"}, "rules": [{"apiGroups": ["*"], "resources": ["pods"], "verbs": ["get"]}]},
    {"kind": "ClusterRole", "metadata": {"name": "x"}, "rules": [{"apiGroups": [""], "resources": ["*"], "verbs": ["get"]}]},
    {"kind": "Role", "metadata": {"name": "x"}, "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["*"]}]},
    {"kind": "Role", "metadata": {"name": "x"}, "rules": [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}]},
    {"kind": "ClusterRole", "metadata": {"name": "x"}, "rules": [{"apiGroups": [""], "resources": ["secrets"],
                                                                  "verbs": ["create", "patch"]}]},
    {"kind": "ClusterRole", "metadata": {"name": "x"}, "rules": [{"apiGroups": [""], "resources": ["users"], "verbs": ["impersonate"]}]},
    {"kind": "ClusterRole", "metadata": {"name": "x"}, "rules": [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]},
    {"kind": "ClusterRoleBinding", "metadata": {"name": "x"}, "roleRef": {"kind": "ClusterRole", "name": "cluster-admin"}},
    {"kind": "RoleBinding", "metadata": {"name": "x"}, "roleRef": {"kind": "ClusterRole", "name": "edit"}},
], ids=["group", "resource", "verb", "secrets", "secrets-patch", "impersonate", "non-resource", "cluster-admin",
        "edit"])
def test_rbac_problems_catches(bad):
    assert rbac_problems([bad])


def test_cluster_role_is_exactly_the_expected_rules(rendered):
    for _overlay, objects in rendered.items():
        cluster_roles = [o for o in objects if o["kind"] == "ClusterRole"]
        assert [role["metadata"]["name"] for role in cluster_roles] == ["gpu-portal"]
        rules = [_rule_key(rule) for rule in cluster_roles[0]["rules"]]
        assert len(rules) == len(set(rules))
        assert set(rules) == EXPECTED_CLUSTER_ROLE_RULES


def test_roles_are_exactly_the_expected_rules_and_bound_to_the_portal_only(rendered):
    for _overlay, objects in rendered.items():
        roles = {o["metadata"]["namespace"]: {_rule_key(rule) for rule in o["rules"]}
                 for o in objects if o["kind"] == "Role"}
        assert roles == EXPECTED_ROLE_RULES
        for binding in (o for o in objects if o["kind"] in ("RoleBinding", "ClusterRoleBinding")):
            assert binding["subjects"] == [{"kind": "ServiceAccount", "name": SERVICE_ACCOUNT,
                                            "namespace": PORTAL_NAMESPACE}]


def test_escalate_and_bind_cover_exactly_the_roles_the_portal_writes(rendered):
    """The portal writes two Roles into every environment that grant what it does not hold itself;
    RBAC lets it only with escalate (writing them) and bind (binding members to them)."""
    from runners.backends import k8s_access, manifests

    written = {manifests.VIEWER_ROLE, manifests.EDITOR_ROLE}
    cluster_role = _named(rendered["default"], "ClusterRole", "gpu-portal")
    for verb in ("escalate", "bind"):
        rules = [rule for rule in cluster_role["rules"] if verb in rule["verbs"]]
        assert len(rules) == 1 and rules[0]["resources"] == ["roles"]
        assert set(rules[0]["resourceNames"]) == written
    # Every binding the portal makes names one of those two Roles.
    assert set(manifests.ROLE_TIERS.values()) == written
    assert k8s_access.RBAC_API_GROUP == manifests.RBAC_API_GROUP


# What the backend does with a kind it holds in a variable, by the function doing it. A new such
# call site fails test_cluster_role_covers_every_call_the_backend_makes until it is added here.
def _variable_kind_calls(backend) -> dict[str, set[tuple[str, str]]]:
    from runners.backends.serve_manifests import endpoint_manifests

    endpoint_kinds = {m["kind"] for m in endpoint_manifests(namespace="x", tenant_slug="t", endpoint_id=1)}
    return {
        # Wrappers: their callers name the kind (see WRAPPER_VERBS).
        "_checked": set(), "_delete": set(), "_controllers": set(), "_member_access_items": set(),
        # Server-side apply of what the manifest builders make: counted from the builders below.
        "_apply": set(),
        "_prune": {(kind, verb) for kind in backend.ENVIRONMENT_KINDS for verb in ("list", "delete")},
        "_read_controller": {(kind, verb) for kind in ("Job", "Deployment") for verb in ("list", "read")},
        "_release_endpoint": {(kind, "delete") for kind in endpoint_kinds},
    }


# Helpers whose first argument is the kind, and the backend verbs each makes.
WRAPPER_VERBS = {"_delete": ("delete",), "_controllers": ("list", "delete"), "_member_access_items": ("list",)}
# The backend's verbs (kubernetes.py VERBS) as RBAC names them.
RBAC_VERB = {"read": "get", "list": "list", "create": "create", "patch": "patch", "replace": "update",
             "delete": "delete"}


def _plural(kind: str) -> str:
    lower = kind.lower()
    return lower[:-1] + "ies" if lower.endswith("y") else lower + "s"


def _backend_needs() -> set[tuple[str, str, str]]:
    """(API group, resource, RBAC verb) of every call in runners/backends/kubernetes.py."""
    from runners.backends import kubernetes as backend
    from runners.backends import manifests

    source = Path(backend.__file__).read_text()
    tree = ast.parse(source)
    calls: set[tuple[str, str, str]] = set()  # (kind, backend verb, subresource)
    variable_sites = set()
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef):
            continue
        for node in ast.walk(function):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"):
                continue
            method = node.func.attr
            if method not in ("_checked", "_call", *WRAPPER_VERBS) or not node.args:
                continue
            first = node.args[0]
            if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
                variable_sites.add(function.name)
                continue
            keywords = {k.arg: k.value for k in node.keywords}
            subresource = keywords["subresource"].value if "subresource" in keywords else ""
            if method in WRAPPER_VERBS:
                verbs = WRAPPER_VERBS[method]
            else:
                verbs = (node.args[1].value,)
                watch = keywords.get("watch")
                if isinstance(watch, ast.Constant) and watch.value is True:
                    verbs = (*verbs, "watch")
            calls |= {(first.value, verb, subresource) for verb in verbs}
    known = _variable_kind_calls(backend)
    assert variable_sites <= set(known), f"calls with the kind in a variable, not yet in _variable_kind_calls: " \
                                         f"{sorted(variable_sites - set(known))}"
    for function in variable_sites:
        calls |= {(kind, verb, "") for kind, verb in known[function]}
    # Everything the manifest builders make is server-side applied (_apply): a PATCH that creates.
    built = set()
    for module in ("manifests", "job_manifests", "serve_manifests", "k8s_access"):
        text = (Path(manifests.__file__).parent / f"{module}.py").read_text()
        built |= set(re.findall(r"\"kind\": \"(\w+)\"", text)) & set(backend.KINDS)
    calls |= {(kind, verb, "") for kind in built for verb in ("create", "patch")}
    assert {kind for kind, _, _ in calls} == set(backend.KINDS), "a kind in KINDS is never called, or one not in it is"
    needs = set()
    for kind, verb, subresource in calls:
        group = backend.KINDS[kind].rpartition("/")[0]
        resource = _plural(kind) + (f"/{subresource}" if subresource else "")
        needs.add((group, resource, "watch" if verb == "watch" else RBAC_VERB[verb]))
    return needs


def _granted(objects: list[dict]) -> set[tuple[str, str, str]]:
    granted = set()
    for obj in objects:
        if obj["kind"] in ("ClusterRole", "Role"):
            for rule in obj["rules"]:
                granted |= {(group, resource, verb) for group in rule["apiGroups"] for resource in rule["resources"]
                            for verb in rule["verbs"]}
    return granted


def test_cluster_role_covers_every_call_the_backend_makes_and_no_other(rendered):
    needs = _backend_needs()
    # A few the reading must find, so a parsing slip cannot pass quietly.
    assert {("", "pods/binding", "create"), ("", "pods/eviction", "create"), ("", "pods/log", "get"),
            ("", "pods", "watch"), ("", "serviceaccounts/token", "create"), ("", "configmaps", "update"),
            ("", "nodes", "patch"), ("rbac.authorization.k8s.io", "roles", "patch")} <= needs
    granted = _granted(rendered["default"])
    assert needs - granted == set(), "calls the portal makes that its roles do not grant"
    # escalate and bind are no calls of their own: RBAC asks for them when the portal writes the
    # members' Roles and RoleBindings (test_escalate_and_bind_cover_exactly_the_roles_the_portal_writes).
    unused = {grant for grant in granted - needs if grant[2] not in ("escalate", "bind")}
    assert unused == set(), "granted, but the backend never makes the call"


# --- The image ---------------------------------------------------------------------------------

BUILD_TOOLS = ("gcc", "g++", "cc", "make", "build-essential", "clang", "cmake", "libpq-dev", "python3-dev", "git")
PINNED_BASE = re.compile(r"python:3\.11\.\d+-slim-bookworm(@sha256:[0-9a-f]{64})?")


def _dockerfile_stages(text: str) -> tuple[dict[str, str], list[tuple[str, list[str]]]]:
    """(ARG defaults before the first FROM, [(FROM line, the stage's instruction lines)])."""
    lines = []
    for raw in re.sub(r"\\\n", " ", text).splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            lines.append(line)
    args, stages = {}, []
    for line in lines:
        instruction = line.split()[0].upper()
        if instruction == "FROM":
            stages.append((line, []))
        elif stages:
            stages[-1][1].append(line)
        elif instruction == "ARG" and "=" in line:
            name, _, value = line.split(None, 1)[1].partition("=")
            args[name] = value.strip("\"'")
    return args, stages


def dockerfile_problems(text: str) -> list[str]:
    """What keeps this Dockerfile from the portal's rules: a multi-stage build on an exactly pinned
    base, a final stage that copies the builder's venv, installs nothing, runs as a numeric non-root
    user, and starts gunicorn with portal/gunicorn_conf.py."""
    args, stages = _dockerfile_stages(text)
    problems = []
    if len(stages) < 2:
        problems.append("not a multi-stage build")
    for line, _ in stages:
        image = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), line.split()[1])
        if not PINNED_BASE.fullmatch(image):
            problems.append(f"base {image} is not python:3.11.<patch>-slim-bookworm")
    final = stages[-1][1] if stages else []
    users = [line.split()[1] for line in final if line.upper().startswith("USER ")]
    if not users:
        problems.append("the final stage sets no USER")
    else:
        ids = users[-1].split(":")
        if not all(part.isdigit() and int(part) != 0 for part in ids):
            problems.append(f"USER {users[-1]} is not a numeric non-root user")
    for line in final:
        if not line.upper().startswith("RUN"):
            continue
        words = set(re.split(r"[\s;&|()]+", line.lower()))
        if re.search(r"apt-get (-\S+ )*install|apk add|\bpip3? install", line.lower()):
            problems.append(f"the final stage installs something: {line}")
        for tool in sorted(words & set(BUILD_TOOLS)):
            problems.append(f"the final stage runs build tool {tool}")
    copies = [line for line in final if line.upper().startswith("COPY --FROM")]
    if not copies or any(line.split()[-1] != "/opt/venv" for line in copies):
        problems.append("the final stage takes more than the venv from the builder")
    commands = [line for line in final if line.upper().startswith(("CMD", "ENTRYPOINT"))]
    if not commands or "gunicorn" not in commands[-1] or "python:portal.gunicorn_conf" not in commands[-1]:
        problems.append("the image does not start gunicorn with portal/gunicorn_conf.py")
    if any("SECRET_KEY" in line for line in final if line.upper().startswith("ENV")):
        problems.append("a SECRET_KEY stays in the image's environment")
    return problems


def test_dockerfile_meets_the_rules():
    assert dockerfile_problems((ROOT / "Dockerfile").read_text()) == []
    assert (ROOT / "portal" / "gunicorn_conf.py").is_file()


@pytest.mark.parametrize("change", [
    ("python:3.11.14-slim-bookworm", "python:3.11-slim"),
    ("python:3.11.14-slim-bookworm", "python:latest"),
    ("USER 10001:10001", "USER portal"),
    ("USER 10001:10001", "USER 0"),
    ("USER 10001:10001", ""),
    ("COPY --from=builder /opt/venv /opt/venv", "COPY --from=builder / /"),
    ("WORKDIR /app", "RUN apt-get update && apt-get install -y gcc\nWORKDIR /app"),
    ("WORKDIR /app", "RUN pip install ipython\nWORKDIR /app"),
    ("EXPOSE 8000", "ENV SECRET_KEY=oops\nEXPOSE 8000"),
], ids=["unpinned", "latest", "named-user", "root", "no-user", "copies-all", "compiler", "pip", "secret"])
def test_dockerfile_problems_catches(change):
    text = (ROOT / "Dockerfile").read_text()
    old, new = change
    assert old in text
    assert dockerfile_problems(text.replace(old, new))


def test_dockerfile_collects_static_files_with_a_throwaway_key():
    _args, stages = _dockerfile_stages((ROOT / "Dockerfile").read_text())
    final = " ".join(stages[-1][1])
    assert "collectstatic" in final and "DEBUG=false" in final
    assert "build-only" in re.search(r"SECRET_KEY=(\S+)", final).group(1)


def test_dockerignore_keeps_local_state_out():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", "var", "staticfiles", "tests"} <= ignored
