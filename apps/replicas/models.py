"""Who serves: a Worker is one engine endpoint; a Rank is one DP rank of it."""

from django.db import models
from django.db.models import OuterRef, Subquery

from apps.replicas.targets import target_key


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
    overrides = models.JSONField(
        default=dict,
        blank=True,
        help_text="facts given at registration that win over discovery (dp_size, block_size, "
        "tokenizer_path, kv_events)",
    )
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
    # Counters persisted periodically from the router's memory (apps.routing.decision.router_stats).
    requests = models.BigIntegerField(default=0)
    prompt_tokens = models.BigIntegerField(default=0)
    cached_tokens = models.BigIntegerField(default=0, help_text="reported by the engine")
    predicted_tokens = models.BigIntegerField(default=0, help_text="matched by the router's index")
    errors = models.BigIntegerField(default=0)

    class Meta:
        ordering = ["worker_id", "rank"]
        constraints = [
            models.UniqueConstraint(fields=["worker", "rank"], name="unique_worker_rank")
        ]

    def __str__(self):
        return target_key(self.worker.url, self.rank)


class WorkerEvent(models.Model):
    """The worker's health history: discovery, taken out, back, drained, refreshed."""

    class Kind(models.TextChoices):
        DISCOVERED = "discovered"
        HEALTHY = "healthy"
        UNHEALTHY = "unhealthy"
        DRAINING = "draining"
        UNDRAINED = "undrained"
        CHANGED = "changed"  # /server_info changed (dp_size, model)
        RESTARTED = "restarted"  # another engine instance answers at the URL: its caches are empty

    worker = models.ForeignKey(Worker, on_delete=models.CASCADE, related_name="events")
    at = models.DateTimeField(auto_now_add=True, db_index=True)
    kind = models.CharField(max_length=16, choices=Kind.choices)
    detail = models.TextField(blank=True, default="")

    class Meta:
        ordering = ["-at", "-id"]

    def __str__(self):
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.kind}"


class RankSample(models.Model):
    """One scrape of a rank's engine-side counters (the engine's own /metrics): the dashboard's
    time series. Counters are cumulative since the engine started; rates come from differences."""

    rank = models.ForeignKey(Rank, on_delete=models.CASCADE, related_name="samples")
    at = models.DateTimeField(db_index=True)
    requests = models.BigIntegerField(default=0)
    prompt_tokens = models.BigIntegerField(default=0)
    cached_tokens = models.BigIntegerField(default=0)
    running = models.IntegerField(default=0)
    waiting = models.IntegerField(default=0)
    kv_blocks_used = models.IntegerField(default=0)
    kv_blocks_total = models.IntegerField(default=0)
    # prefill/decode disaggregation: KV a decode rank pulled, a prefill rank sent (cumulative)
    kv_blocks_pulled = models.BigIntegerField(default=0)
    kv_bytes_pulled = models.BigIntegerField(default=0)
    kv_bytes_sent = models.BigIntegerField(default=0)
    up = models.BooleanField(default=True)

    class Meta:
        ordering = ["at", "id"]
        indexes = [models.Index(fields=["rank", "at"])]

    @property
    def hit_rate(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None

    @classmethod
    def latest_of(cls, rank_ids) -> models.QuerySet:
        """Each of these ranks' newest sample (nothing for a rank without one), in one query that
        reads each rank's newest row through the (rank, at) index, however many samples it has."""
        newest = cls.objects.filter(rank_id=OuterRef("id")).order_by("-at", "-id").values("id")[:1]
        ranks = Rank.objects.filter(id__in=list(rank_ids))
        return cls.objects.filter(id__in=ranks.values(last=Subquery(newest)))
