"""The decision: which target serves a request. Pure computation over in-memory state (the fleet,
the prefix index, the load, the sessions, the policies): no Django, no aiohttp, no I/O, so it can
be read and tested alone. The proxy calls it; the feeds keep its state current."""
