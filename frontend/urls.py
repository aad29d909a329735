from django.contrib.auth import views as auth_views
from django.urls import path

from frontend import views

urlpatterns = [
    path(
        "login/",
        auth_views.LoginView.as_view(template_name="frontend/login.html", redirect_authenticated_user=True),
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
]
