"""The dashboard's websocket: pushes a fleet snapshot on connect, after every scrape (any
process's scrape job nudges the ``dashboard`` group through the channel layer) and at least every
scrape interval (the router's in-flight numbers move between scrapes); takes the policy switch."""

from __future__ import annotations

import asyncio
import logging

from asgiref.sync import sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings

from apps.routing.jobs import DASHBOARD_GROUP
from apps.routing.live import live_of, router_of
from apps.routing.selectors import build_snapshot
from apps.routing.services import policy_set

logger = logging.getLogger(__name__)

NOT_AUTHORIZED = 4403  # a close code in the application range: the page stops reconnecting


class DashboardConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self):
        user = self.scope.get("user")
        if not (user and user.is_authenticated and user.is_active and user.is_staff):
            await self.close(code=NOT_AUTHORIZED)
            return
        self.pending = asyncio.Event()
        await self.channel_layer.group_add(DASHBOARD_GROUP, self.channel_name)
        await self.accept()
        self.pusher = asyncio.ensure_future(self.push_loop())

    async def disconnect(self, code):
        pusher = getattr(self, "pusher", None)
        if pusher is not None:
            pusher.cancel()
            await self.channel_layer.group_discard(DASHBOARD_GROUP, self.channel_name)

    async def push_loop(self):
        """One snapshot now, then one per nudge or per interval, whichever comes first. Nudges
        that arrive while a snapshot is being built collapse into the next one."""
        interval = settings.CONTROL_PLANE["SCRAPE_INTERVAL_S"]
        while True:
            self.pending.clear()
            try:
                await self.send_json(await sync_to_async(build_snapshot)(*_served(self.scope)))
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("building the dashboard snapshot failed")
            try:
                await asyncio.wait_for(self.pending.wait(), timeout=interval)
            except TimeoutError:
                pass

    async def fleet_changed(self, event):
        self.pending.set()

    @classmethod
    async def decode_json(cls, text_data):
        try:
            return await super().decode_json(text_data)
        except ValueError:
            return None  # answered as an unknown action, the socket stays open

    async def receive_json(self, content, **kwargs):
        if not isinstance(content, dict) or content.get("action") != "set_policy":
            await self.send_json({"type": "error", "message": "unknown action"})
            return
        try:
            await policy_set(
                router=router_of(self.scope),
                name=str(content.get("policy")),
                by=self.scope["user"].get_username(),
            )
        except ValueError as exc:
            await self.send_json({"type": "error", "message": str(exc)})


def _served(scope) -> tuple:
    """The router and admission control of the process serving this websocket."""
    live = live_of(scope)
    return live.router, live.admission
