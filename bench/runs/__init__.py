"""The experiment runs: each module answers one question about the engine or the routers, with
the load-generator library (``bench``) and real processes (``harness``). Run one as
``python -m bench.runs.<name>``; its docstring says what it measures and how to run it."""
