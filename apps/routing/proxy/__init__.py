"""The hot path: the OpenAI endpoints as a plain ASGI app, admission control, the upstream call
and relay, and what each engine flavour wants on the wire. It asks the decision where a request
goes and owns the request until its answer has been relayed."""
