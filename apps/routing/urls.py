"""HTTP routes of the routing app, mounted at the site root by ``controlplane.urls``."""

urlpatterns = []
