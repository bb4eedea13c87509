"""The engine's HTTP server: a front process (ASGI under daphne) and N DP rank processes."""
