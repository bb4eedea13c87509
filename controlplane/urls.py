"""Root URLconf: the admin, and the routing app (OpenAI proxy, stats, dashboard) at the root."""

from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("", include("apps.routing.urls")),
]
