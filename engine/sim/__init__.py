"""The simulated engine: the real engine with the model's forward pass replaced by a step-time
model (``runengine --simulate PROFILE``), for routing experiments at fleet scale on a CPU.

Only the runner is simulated. Front, DP rank processes, scheduler, block manager (real digests,
LRU, KV events), metrics, detokenizer and stop logic are the engine's own code. Nothing under
``engine.sim`` imports torch or transformers: 32 simulated ranks fit in a few GB.

- ``step_time``: the cost of one engine step from its shape (prefill tokens, decodes, context).
- ``profiles``: named hardware/model pairs (coefficients, KV capacity, limits) with sources.
- ``runner``: ``SimulatedRunner``, the stand-in for ``ModelRunner``.
- ``fit``: the least-squares fit of the step-time model to measured steps; the measuring is
  ``python -m engine.fit_step_time``, which times our own CPU engine and fits ``cpu-tiny``.
- ``memcheck``: ``python -m engine.sim.memcheck`` starts a simulated server and reports its RSS.

Arrows: ``engine.llm_engine`` imports ``engine.sim.runner`` when ``EngineConfig.simulate`` asks
for it (the simulated runner is one of the engine's runners), and ``engine.server.main`` reads
``engine.sim.profiles``. Nothing under ``engine.sim`` imports ``engine.llm_engine`` or the server:
tools that drive the whole engine (``engine.fit_step_time``) live above, outside this package.
"""
