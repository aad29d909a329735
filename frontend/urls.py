from django.contrib.auth import views as auth_views
from django.urls import path

from frontend import endpoint_views, job_views, token_views, usage_views, views
from frontend.forms import LoginForm

urlpatterns = [
    path(
        "login/",
        views.throttled_login(
            auth_views.LoginView.as_view(
                template_name="frontend/login.html", authentication_form=LoginForm, redirect_authenticated_user=True
            )
        ),
        name="login",
    ),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("", views.dashboard, name="dashboard"),
    path("tenants/<slug:slug>/", views.tenant_detail, name="tenant"),
    path("tenants/<slug:slug>/environments/new/", views.environment_create, name="environment-create"),
    path("tenants/<slug:slug>/members/new/", views.member_add, name="member-add"),
    path("tenants/<slug:slug>/members/<str:username>/remove/", views.member_remove, name="member-remove"),
    path("environments/<int:environment_id>/", views.environment_detail, name="environment"),
    path("environments/<int:environment_id>/status/", views.environment_status, name="environment-status"),
    path("environments/<int:environment_id>/row/", views.environment_row, name="environment-row"),
    path("environments/<int:environment_id>/delete/", views.environment_delete, name="environment-delete"),
    path("tenants/<slug:slug>/quota/", views.tenant_quota, name="tenant-quota"),
    path("tenants/<slug:slug>/usage/", usage_views.tenant_usage, name="tenant-usage"),
    path("tenants/<slug:slug>/jobs/", job_views.job_list, name="jobs"),
    path("tenants/<slug:slug>/jobs/new/", job_views.job_submit, name="job-submit"),
    path("jobs/<int:job_id>/", job_views.job_detail, name="job"),
    path("jobs/<int:job_id>/live/", job_views.job_live, name="job-live"),
    path("jobs/<int:job_id>/cancel/", job_views.job_cancel, name="job-cancel"),
    path("tenants/<slug:slug>/endpoints/", endpoint_views.endpoint_list_page, name="endpoints"),
    path("tenants/<slug:slug>/endpoints/new/", endpoint_views.endpoint_deploy, name="endpoint-deploy"),
    path("endpoints/<int:endpoint_id>/", endpoint_views.endpoint_detail, name="endpoint"),
    path("endpoints/<int:endpoint_id>/live/", endpoint_views.endpoint_live, name="endpoint-live"),
    path("endpoints/<int:endpoint_id>/scale/", endpoint_views.endpoint_scale, name="endpoint-scale"),
    path("endpoints/<int:endpoint_id>/rollout/", endpoint_views.endpoint_rollout, name="endpoint-rollout"),
    path("endpoints/<int:endpoint_id>/stop/", endpoint_views.endpoint_stop, name="endpoint-stop"),
    path("tokens/", token_views.token_list, name="tokens"),
    path("tokens/new/", token_views.token_create, name="token-create"),
    path("tokens/<int:token_id>/revoke/", token_views.token_revoke, name="token-revoke"),
    path("quotas/", views.quota_table, name="quotas"),
    path("quotas/set/", views.quota_set, name="quota-set"),
    path("quotas/<int:quota_id>/remove/", views.quota_remove, name="quota-remove"),
    path("usage/cluster/", usage_views.cluster_usage, name="cluster-usage"),
    path("partitions/", views.partition_list, name="partitions"),
    path("partitions/new/", views.partition_create, name="partition-create"),
    path("partitions/preview/", views.partition_preview, name="partition-preview"),
    path("node-pools/", views.node_pool_list, name="node-pools"),
    path("node-pools/<int:pool_id>/", views.node_pool_detail, name="node-pool"),
    path("node-pools/<int:pool_id>/live/", views.node_pool_live, name="node-pool-live"),
    path("node-pools/<int:pool_id>/apply/", views.node_pool_apply, name="node-pool-apply"),
    path("node-pools/<int:pool_id>/apply/preview/", views.node_pool_apply_preview, name="node-pool-apply-preview"),
]
