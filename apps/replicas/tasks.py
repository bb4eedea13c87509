"""Celery tasks of the replicas' periodic jobs: thin wrappers around ``apps.replicas.jobs`` (the
same code runs embedded in a router process without a broker). Beat's schedule is in
``controlplane/celery.py``."""

from celery import shared_task

from apps.replicas import jobs


@shared_task(name="replicas.scrape_fleet", ignore_result=True)
def scrape_fleet() -> int:
    return jobs.scrape_fleet()


@shared_task(name="replicas.prune")
def prune() -> dict:
    return jobs.prune()


@shared_task(name="replicas.refresh_discovery")
def refresh_discovery() -> dict:
    return jobs.refresh_discovery()
