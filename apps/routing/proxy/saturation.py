"""The saturation rule of admission control (apps/routing/proxy/admission.py): when new requests
wait although a slot is free, because the engines themselves are full.

A target is saturated at or above either threshold (0: that one is off):

- ``--saturation-queued-prefill-tokens``: prefill tokens dispatched to it that no engine has
  started yet, every router process's (``RankLoad.queued_prefill_tokens``);
- ``--saturation-kv-usage``: the fraction of its KV cache in use, the engine's own figure
  (``Target.kv_usage``, from the latest scrape of its /metrics that ``FleetSync`` applied, a few
  seconds old). Where no recent scrape answered the usage is unknown, and an unknown usage never
  saturates: a target is not held back on a guess.

The fleet is saturated when every available target is: one that can still take work is enough
to admit. A fleet with no target available is not saturated, since routing answers that with a
503 at once and waiting would not help.
"""

from __future__ import annotations


def target_saturated(target, queued_prefill_tokens: int, kv_usage: float) -> bool:
    """At or above a threshold (0: that one is off); an unknown KV usage is never above."""
    if queued_prefill_tokens > 0 and target.load.queued_prefill_tokens >= queued_prefill_tokens:
        return True
    return kv_usage > 0 and target.kv_usage is not None and target.kv_usage >= kv_usage


def fleet_saturated(fleet, queued_prefill_tokens: int, kv_usage: float) -> bool:
    """Every available target is saturated. None available: not saturated (routing answers
    that with a 503 at once; waiting would not help)."""
    seen = False
    for target in fleet.all_targets():
        if target.available:
            if not target_saturated(target, queued_prefill_tokens, kv_usage):
                return False
            seen = True
    return seen
