"""``manage.py runrouter``: the control plane alone (mesh-only), in front of running engines."""

from django.core.management import call_command
from django.core.management.base import BaseCommand

from apps.routing.flags import add_router_arguments
from apps.routing.process import serve_router
from controlplane.bootstrap import ensure_admin_user


class Command(BaseCommand):
    help = "Run the cache-aware router in front of existing engines (--worker-urls ... --dp-aware)."
    requires_system_checks = []

    def add_arguments(self, parser):
        add_router_arguments(parser)

    def handle(self, *args, **options):
        call_command("migrate", interactive=False, verbosity=0)
        host, port = options["host"], options["port"]
        admin = ensure_admin_user()
        serve_router(
            options,
            on_ready=lambda: self.stdout.write(
                f"Router on http://{host}:{port}; "
                f"dashboard http://{host}:{port}/dashboard/ ({admin})",
                ending="\n",
            ),
        )
