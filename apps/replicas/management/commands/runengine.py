"""``manage.py runengine``: the inference engine (N DP ranks + OpenAI HTTP front)."""

from django.core.management.base import BaseCommand

from engine.server.main import add_arguments, serve


class Command(BaseCommand):
    help = "Run the inference engine: N DP rank processes behind an OpenAI-compatible HTTP server."
    requires_system_checks = []  # the engine needs no database

    def add_arguments(self, parser):
        add_arguments(parser)

    def handle(self, *args, **options):
        import argparse

        code = serve(argparse.Namespace(**options))
        if code:
            raise SystemExit(code)
