"""The first admin of a fresh control plane, for the commands that serve it (``runrouter``,
``serve``): created from Django's own environment variables when they are set."""

from __future__ import annotations

import os

from django.contrib.auth import get_user_model
from django.core.management import call_command


def ensure_admin_user() -> str:
    """Create the first admin from ``DJANGO_SUPERUSER_USERNAME`` / ``DJANGO_SUPERUSER_PASSWORD``
    (/ ``DJANGO_SUPERUSER_EMAIL``; Django's own names) when set and absent. Returns one line for
    the banner: who can log in, or how to create someone who can."""
    users = get_user_model().objects
    name = os.environ.get("DJANGO_SUPERUSER_USERNAME", "").strip()
    if (
        name
        and os.environ.get("DJANGO_SUPERUSER_PASSWORD")
        and not users.filter(username=name).exists()
    ):
        os.environ.setdefault("DJANGO_SUPERUSER_EMAIL", "")
        call_command("createsuperuser", interactive=False, username=name, verbosity=0)
        return (
            f"admin user {name!r} created from DJANGO_SUPERUSER_USERNAME / "
            "DJANGO_SUPERUSER_PASSWORD"
        )
    if users.filter(is_staff=True, is_active=True).exists():
        return "log in with a staff account"
    return (
        "no admin user yet: run `python manage.py createsuperuser`, or start with "
        "DJANGO_SUPERUSER_USERNAME and DJANGO_SUPERUSER_PASSWORD set"
    )
