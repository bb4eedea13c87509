"""The Celery app. With ``REDIS_URL`` it uses Redis as broker and result backend; without
it tasks run eagerly in the sending process (the embedded mode). Both come from the
``CELERY_*`` entries in settings, which read ``REDIS_URL``.
"""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("controlplane")
app.config_from_object("django.conf:settings", namespace="CELERY")
# Finds ``tasks.py`` in every installed app once Django's app registry is ready.
app.autodiscover_tasks()
