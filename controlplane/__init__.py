"""The Django project of the control plane."""

# Imported here so that ``@shared_task`` binds to this app whenever Django starts.
from controlplane.celery import app as celery_app

__all__ = ("celery_app",)
