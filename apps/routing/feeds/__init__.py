"""What keeps the decision's state true while requests flow: worker health, the database sync,
the engines' KV events (ours and vLLM's), the index and load shared between router processes,
and the stats written back to the database. Each runs as a background loop of the router
process, handed the router when the process is composed (apps/routing/process.py)."""
