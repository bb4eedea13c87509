"""The Celery app. With ``REDIS_URL`` it uses Redis as broker and result backend, and a worker
plus beat run the periodic jobs (``celery -A controlplane worker --beat``); without it tasks run
eagerly where they are sent and the router process schedules the periodic jobs itself
(apps/routing/jobs.py, embedded_jobs_loop; the jobs themselves: apps/replicas/jobs.py). Both read
the ``CELERY_*`` settings and the same intervals.
"""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("controlplane")
app.config_from_object("django.conf:settings", namespace="CELERY")
# Finds ``tasks.py`` in every installed app once Django's app registry is ready.
app.autodiscover_tasks()


@app.on_after_configure.connect
def schedule_periodic_jobs(sender, **kwargs):
    from django.conf import settings

    cp = settings.CONTROL_PLANE
    # a scrape that waited longer than one interval is stale: drop it rather than pile up
    sender.add_periodic_task(
        cp["SCRAPE_INTERVAL_S"],
        sender.signature("replicas.scrape_fleet"),
        name="scrape engines",
        expires=cp["SCRAPE_INTERVAL_S"],
    )
    sender.add_periodic_task(
        cp["DISCOVERY_REFRESH_INTERVAL_S"],
        sender.signature("replicas.refresh_discovery"),
        name="refresh discovery",
    )
    sender.add_periodic_task(
        cp["PRUNE_INTERVAL_S"], sender.signature("replicas.prune"), name="prune time series"
    )
