"""The benchmark client: an async OpenAI-API load generator (``python -m bench --help``).

No Django here: it runs against any OpenAI-compatible server, ours or not. The experiment runs
that use it live in ``bench.runs``; the server processes they start, in ``harness``.
"""
