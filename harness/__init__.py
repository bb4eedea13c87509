"""Process helpers shared by the benchmarks (``bench``) and the tests (``tests``): servers as real
processes, the router's command line, a stand-in OpenAI server and a vLLM-CPU server.

A neutral package: it imports neither ``bench`` nor ``tests``, so those two need not import each
other (tests/controlplane/test_structure.py holds that)."""
