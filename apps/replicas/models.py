"""Who serves: a Worker is one engine endpoint; a Rank is one DP rank of it."""
from django.db import models


class Worker(models.Model):
    """One OpenAI-compatible server. ``server_info`` is its whole /server_info answer."""

    class Health(models.TextChoices):
        UNKNOWN = "unknown"
        HEALTHY = "healthy"
        UNHEALTHY = "unhealthy"

    url = models.URLField(unique=True, max_length=500)
    api_key = models.CharField(max_length=500, blank=True, default="")
    model_id = models.CharField(max_length=500, blank=True, default="")
    served_model_name = models.CharField(max_length=500, blank=True, default="")
    dp_size = models.PositiveIntegerField(default=1)
    dp_aware = models.BooleanField(default=True, help_text="one routing target per DP rank")
    server_info = models.JSONField(default=dict, blank=True)
    health = models.CharField(max_length=16, choices=Health.choices, default=Health.UNKNOWN)
    health_detail = models.TextField(blank=True, default="")
    draining = models.BooleanField(default=False, help_text="receives no new requests")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    last_checked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["id"]

    def __str__(self):
        return f"{self.url} (dp {self.dp_size})"

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_id


class Rank(models.Model):
    """One routing target: a DP rank of a dp-aware worker, or the whole worker (rank None)."""

    worker = models.ForeignKey(Worker, on_delete=models.CASCADE, related_name="ranks")
    rank = models.PositiveIntegerField(null=True, blank=True)
    circuit_state = models.CharField(max_length=16, default="closed")
    # Counters persisted periodically from the router's memory (apps.routing.stats).
    requests = models.BigIntegerField(default=0)
    prompt_tokens = models.BigIntegerField(default=0)
    cached_tokens = models.BigIntegerField(default=0, help_text="reported by the engine")
    predicted_tokens = models.BigIntegerField(default=0, help_text="matched by the router's index")
    errors = models.BigIntegerField(default=0)

    class Meta:
        ordering = ["worker_id", "rank"]
        constraints = [models.UniqueConstraint(fields=["worker", "rank"], name="unique_worker_rank")]

    def __str__(self):
        return self.worker.url if self.rank is None else f"{self.worker.url}@{self.rank}"
