from django.apps import AppConfig


class ReplicasConfig(AppConfig):
    """Workers, their DP ranks, discovery, health and the serving commands."""

    name = "apps.replicas"
    verbose_name = "Replicas"
