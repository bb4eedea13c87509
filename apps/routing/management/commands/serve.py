"""``manage.py serve``: everything in one command — an engine (N DP ranks) and a dp-aware,
cache-aware router in front of it, with the dashboard. With no arguments: the built-in tiny
model on SQLite. ``--pd``: a prefill engine (on ``--engine-port``) and a decode engine (the port
after it), each N DP ranks, behind a router in prefill/decode mode (docs/routing.md)."""

import os
import signal
import subprocess
import sys

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand

from apps.routing.decision.policies import POLICY_NAMES
from apps.routing.process import serve_router
from controlplane.bootstrap import ensure_admin_user


class Command(BaseCommand):
    help = "Run an engine and a cache-aware router on it (the embedded default)."
    requires_system_checks = []

    def add_arguments(self, parser):
        parser.add_argument(
            "--model", default="tiny", help="'tiny' or a local Hugging Face model directory"
        )
        parser.add_argument("--dp-size", type=int, default=2)
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000, help="the router (what clients use)")
        parser.add_argument("--engine-port", type=int, default=8001)
        parser.add_argument(
            "--policy",
            default=None,
            choices=POLICY_NAMES,
        )
        parser.add_argument(
            "--api-key",
            action="append",
            default=None,
            metavar="KEY",
            help="require 'Authorization: Bearer KEY' on the OpenAI endpoints (repeatable)",
        )
        parser.add_argument(
            "--admin-key",
            action="append",
            default=None,
            metavar="KEY",
            help="Bearer key for the workers API's mutations (repeatable)",
        )
        parser.add_argument(
            "--router-workers",
            type=int,
            default=1,
            help="router processes on the port (N > 1 needs REDIS_URL: docs/operations.md)",
        )
        parser.add_argument(
            "--pd",
            action="store_true",
            help="prefill/decode disaggregation: a prefill engine on --engine-port, a decode "
            "engine on the port after it, the router in --pd-disaggregation mode",
        )
        parser.add_argument(
            "--engine-arg",
            action="append",
            default=[],
            help="extra runengine flag, repeatable (e.g. --engine-arg=--num-kv-blocks=512)",
        )

    def handle(self, *args, **o):
        call_command("migrate", interactive=False, verbosity=0)
        admin = ensure_admin_user()
        roles = ("prefill", "decode") if o["pd"] else (None,)
        engines, urls = [], []
        for offset, role in enumerate(roles):
            port = o["engine_port"] + offset
            urls.append(f"http://127.0.0.1:{port}")
            cmd = [
                sys.executable,
                os.path.join(settings.BASE_DIR, "manage.py"),
                "runengine",
                "--model",
                o["model"],
                "--dp-size",
                str(o["dp_size"]),
                "--port",
                str(port),
                "--host",
                "127.0.0.1",
                *(["--disaggregation-mode", role, "--disaggregation-bootstrap-port", "0"]
                  if role else []),
                *o["engine_arg"],
            ]  # fmt: skip
            engines.append(subprocess.Popen(cmd))
        engine_url = " and ".join(urls)
        url = f"http://{o['host']}:{o['port']}"
        banner = (
            f"\n  OpenAI API   {url}/v1  (e.g. curl {url}/v1/chat/completions -d "
            f'\'{{"messages":[{{"role":"user","content":"hi"}}]}}\')\n'
            f"  Dashboard    {url}/dashboard/  ({admin})\n  Admin        {url}/admin/\n"
            f"  Workers API  {url}/workers\n  Metrics      {url}/metrics\n"
            f"  Engine       {engine_url} "
            f"(dp_size {o['dp_size']}; the router discovers it when it is ready)\n"
        )
        try:
            workers = (
                {"pd_disaggregation": True, "prefill": [[urls[0]]], "decode": [urls[1]]}
                if o["pd"]
                else {"worker_urls": urls}
            )
            serve_router(
                {
                    **workers,
                    "dp_aware": True,
                    "policy": o["policy"],
                    "host": o["host"],
                    "port": o["port"],
                    "api_key": o["api_key"],
                    "admin_key": o["admin_key"],
                    "workers": o["router_workers"],
                },
                on_ready=lambda: self.stdout.write(banner),
            )
        finally:
            for engine in engines:
                engine.send_signal(signal.SIGINT)
            for engine in engines:
                try:
                    engine.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    engine.kill()
