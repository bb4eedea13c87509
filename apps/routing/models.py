"""The routing app's durable state: the active policy (switchable at runtime) and benchmark runs."""

from django.conf import settings
from django.db import models

from apps.routing.decision.policies import POLICY_NAMES

POLICY_CHOICES = [(name, name) for name in POLICY_NAMES]


class RoutingSettings(models.Model):
    """One row: what every router process applies (the dashboard writes it, routers poll it)."""

    policy = models.CharField(max_length=32, choices=POLICY_CHOICES, default="cache_aware")
    updated_at = models.DateTimeField(auto_now=True)
    updated_by = models.CharField(max_length=150, blank=True, default="")

    class Meta:
        verbose_name_plural = "routing settings"

    def __str__(self):
        return f"policy {self.policy}"

    @classmethod
    def load(cls) -> "RoutingSettings":
        row, _ = cls.objects.get_or_create(
            id=1, defaults={"policy": settings.CONTROL_PLANE["POLICY"]}
        )
        return row


class BenchRun(models.Model):
    """An on-demand benchmark against the live fleet (a Celery job), and what it measured."""

    class Status(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        DONE = "done"
        FAILED = "failed"

    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    created_by = models.CharField(max_length=150, blank=True, default="")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.QUEUED)
    base_url = models.CharField(max_length=500, help_text="the router the workload is sent to")
    params = models.JSONField(default=dict, blank=True)
    result = models.JSONField(default=dict, blank=True)
    error = models.TextField(blank=True, default="")

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self):
        return f"bench #{self.id} {self.params.get('dataset', '')} ({self.status})"
