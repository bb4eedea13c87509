"""Celery tasks: thin wrappers around ``apps.routing.jobs`` (the same code runs embedded).

With ``REDIS_URL`` set, run a worker and beat next to the router(s):

    celery -A controlplane worker --beat --loglevel INFO

Beat's schedule (``controlplane/celery.py``) comes from the CONTROL_PLANE intervals. Without
``REDIS_URL`` the router process runs the same jobs itself (``jobs.embedded_jobs_loop``).
"""

from celery import shared_task

from apps.routing import jobs


@shared_task(name="routing.scrape_fleet", ignore_result=True)
def scrape_fleet() -> int:
    return jobs.scrape_fleet()


@shared_task(name="routing.prune")
def prune() -> dict:
    return jobs.prune()


@shared_task(name="routing.refresh_discovery")
def refresh_discovery() -> dict:
    return jobs.refresh_discovery()


@shared_task(name="routing.run_bench")
def run_bench(run_id: int) -> dict:
    return jobs.run_bench(run_id)
