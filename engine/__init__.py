"""A small data-parallel inference engine: paged KV cache, prefix caching, continuous batching.

Nothing in this package imports Django except the HTTP glue in ``engine.server``.
"""
