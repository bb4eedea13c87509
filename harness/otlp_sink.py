"""A small OTLP/HTTP trace receiver: what a collector does with ``POST /v1/traces``, keeping each
span as one JSON line in a file (its service, ids, parent, name, kind, times, attributes, events).

    python -m harness.otlp_sink --port 4318 --out spans.jsonl

The tests point ``OTEL_EXPORTER_OTLP_ENDPOINT`` at it; ``GET /health`` says it is up."""

from __future__ import annotations

import argparse
import gzip
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def spans_of(payload: bytes) -> list[dict]:
    """The spans of one ``ExportTraceServiceRequest`` (protobuf), flattened."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    request = ExportTraceServiceRequest()
    request.ParseFromString(payload)
    out = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                out.append({
                    "service": resource.get("service.name"),
                    "trace_id": span.trace_id.hex(),
                    "span_id": span.span_id.hex(),
                    "parent_span_id": span.parent_span_id.hex() or None,
                    "name": span.name,
                    "kind": span.kind,
                    "start_ns": span.start_time_unix_nano,
                    "end_ns": span.end_time_unix_nano,
                    "attributes": {a.key: _value(a.value) for a in span.attributes},
                    "events": [{"name": e.name, "time_ns": e.time_unix_nano,
                                "attributes": {a.key: _value(a.value) for a in e.attributes}}
                               for e in span.events],
                })  # fmt: skip
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", required=True, help="spans as JSON lines, appended")
    args = parser.parse_args(argv)
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self._answer(200 if self.path == "/health" else 404, b"{}")

        def do_POST(self):  # noqa: N802
            if self.path != "/v1/traces":
                self._answer(404, b"{}")
                return
            payload = self.rfile.read(int(self.headers.get("content-length") or 0))
            if self.headers.get("content-encoding") == "gzip":
                payload = gzip.decompress(payload)
            try:
                spans = spans_of(payload)
            except Exception as exc:  # a malformed export: the exporter is told
                self._answer(400, json.dumps({"error": str(exc)}).encode())
                return
            with lock, open(args.out, "a") as fh:
                fh.writelines(json.dumps(s) + "\n" for s in spans)
            self._answer(200, b"", "application/x-protobuf")

        def _answer(self, status: int, body: bytes, kind: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("content-type", kind)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # quiet
            pass

    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
