"""The control plane's Django apps: ``replicas`` (who serves) and ``routing`` (where a request
goes)."""
