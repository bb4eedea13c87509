from django.apps import AppConfig


class RoutingConfig(AppConfig):
    """Where requests go: the decision, the proxy, the feeds, the dashboard and its jobs."""

    name = "apps.routing"
    verbose_name = "Routing"

    def ready(self) -> None:
        from apps.replicas.jobs import fleet_scraped
        from apps.routing.jobs import on_scraped

        fleet_scraped.connect(on_scraped, dispatch_uid="routing.dashboard_on_scrape")
