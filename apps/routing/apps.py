from django.apps import AppConfig


class RoutingConfig(AppConfig):
    """Prefix digests, the per-rank digest index, policies, the OpenAI proxy and stats."""

    name = "apps.routing"
    verbose_name = "Routing"
