"""What every HTTP server of this project needs, the engine's front and the router's proxy alike:
ASGI body and stream helpers, the OpenAI request fields read before any model is involved, and
the graceful drain on SIGTERM. It imports neither ``engine`` nor ``apps``."""
