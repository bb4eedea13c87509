"""The OpenAI error body, one home for the control plane's answers:
``{"error": {"message", "type", "param", "code"}}`` with the HTTP status (``code`` is the status
unless a more specific code is given, as OpenAI's ``invalid_api_key``).

The engine and the proxy write the same shape with ``serving.openai_fields.APIError``; the
engine imports nothing from the control plane.
"""

from __future__ import annotations

import json


def error_payload(
    status: int, message: str, type: str = "invalid_request_error", code: str | int | None = None
) -> dict:
    return {
        "error": {
            "message": message,
            "type": type,
            "param": None,
            "code": status if code is None else code,
        }
    }


def error_bytes(status: int, message: str, type: str = "invalid_request_error", code=None) -> bytes:
    return json.dumps(error_payload(status, message, type, code)).encode()


def error_response(status: int, message: str, type: str = "invalid_request_error", code=None):
    """A Django ``JsonResponse`` carrying the error (401s also say ``WWW-Authenticate``)."""
    from django.http import JsonResponse

    response = JsonResponse(error_payload(status, message, type, code), status=status)
    if status == 401:
        response["WWW-Authenticate"] = "Bearer"
    return response
