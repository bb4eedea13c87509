"""Celery tasks of the routing app: the dashboard's benchmark runs (apps/routing/jobs.py); the
periodic jobs are the replicas' (apps/replicas/tasks.py).

With ``REDIS_URL`` set, run a worker and beat next to the router(s):

    celery -A controlplane worker --beat --loglevel INFO

Beat's schedule (``controlplane/celery.py``) comes from the CONTROL_PLANE intervals. Without
``REDIS_URL`` the router process runs the same jobs itself (``jobs.embedded_jobs_loop``).
"""

from celery import shared_task

from apps.routing import jobs


@shared_task(name="routing.run_bench")
def run_bench(run_id: int) -> dict:
    return jobs.run_bench(run_id)
