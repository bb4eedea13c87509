"""A small data-parallel inference engine: paged KV cache, prefix caching, continuous batching.

Nothing in this package imports Django; ``manage.py runengine`` is a thin wrapper over
``engine.server.main``.

The arrows point down, and no two modules import each other, not even inside a function
(tests/controlplane/test_structure.py):

- ``engine.server`` (the HTTP front and the rank processes) and the tools ``engine.bench`` and
  ``engine.fit_step_time`` drive
- ``engine.llm_engine``, which loads one runner: ``engine.model_runner`` (the model; it imports
  ``engine.native_llama``, and both import ``engine.paged_attention`` and
  ``engine.paged_context``) or ``engine.sim.runner`` (a step-time model; ``engine.sim`` never
  imports the engine back);
- below them the scheduler, block manager, sequences, sampling, digests and config.
"""
