"""``manage.py bench``: the benchmark client of ``bench/`` (same flags as ``python -m bench``)."""

import argparse

from django.core.management.base import BaseCommand

from bench.cli import add_arguments, run


class Command(BaseCommand):
    help = (
        "Benchmark an OpenAI-compatible server (prefix_repetition, random or multi_turn workloads)."
    )
    requires_system_checks = []  # a client: it needs no database

    def add_arguments(self, parser):
        add_arguments(parser)

    def handle(self, *args, **options):
        report = run(argparse.Namespace(**options))
        if not report["summary"]["completed"]:
            raise SystemExit(1)
