"""Where a request goes: prefix digests, the per-rank index, policies and the OpenAI proxy."""
