"""Access control: who may change the fleet, and who may use the OpenAI endpoints.

Two comma-separated lists in ``settings.CONTROL_PLANE`` (env ``CONTROL_PLANE_ADMIN_KEYS`` /
``CONTROL_PLANE_API_KEYS``, or ``runrouter --admin-key`` / ``--api-key``):

* ``ADMIN_KEYS``: the fleet's mutations (``POST /workers``, ``DELETE /workers/{id}``,
  ``POST /add_worker``, ``POST /remove_worker``) need ``Authorization: Bearer <admin key>``, or a
  logged-in staff user's session (the admin's login) with a valid CSRF token. With no admin key
  configured, only staff sessions may change the fleet: anonymous mutations are always refused.
  Reads stay open, as in SGLang's router: ``GET /workers``, ``GET /workers/{id}`` and
  ``GET /list_workers`` answer anyone who can reach the router.
* ``API_KEYS``: when non-empty, ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``
  need ``Authorization: Bearer <api key>`` (vLLM's ``--api-key``); when empty they are open.
  ``/health`` and ``/metrics`` are always open.

The settings are read on every check (a dict lookup and a split: nothing worth caching), so
``override_settings`` and ``serve_router``'s flags apply at once.
"""

from __future__ import annotations

import hmac
from functools import wraps

from django.conf import settings
from django.http import JsonResponse
from django.middleware.csrf import CsrfViewMiddleware

from controlplane.errors import error_bytes, error_response

SAFE_METHODS = ("GET", "HEAD", "OPTIONS")

INVALID_API_KEY = ("Incorrect API key provided.", "invalid_request_error", "invalid_api_key")
INVALID_API_KEY_BODY = error_bytes(401, *INVALID_API_KEY)


def configured_keys(name: str) -> list[str]:
    """The keys of ``settings.CONTROL_PLANE[name]``: comma-separated, stripped, empties dropped
    (read on every request: parsed again only when the setting changed)."""
    raw = settings.CONTROL_PLANE.get(name) or ""
    known = _parsed.get(name)
    if known is not None and known[0] is raw:
        return known[1]
    items = raw if isinstance(raw, (list, tuple)) else str(raw).split(",")
    keys = [k.strip() for k in items if k and k.strip()]
    _parsed[name] = (raw, keys)
    return keys


_parsed: dict[str, tuple[object, list[str]]] = {}  # name -> (the setting's value, its keys)


def bearer_token(authorization: str | bytes | None) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header value, as bytes; None if absent."""
    if not authorization:
        return None
    if isinstance(authorization, str):
        # Django decodes header bytes as latin-1: encoding back gives the bytes that were sent.
        authorization = authorization.encode("latin-1", errors="replace")
    scheme, _, token = authorization.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    token = token.strip()
    return token or None


def key_matches(token: bytes | None, keys: list[str]) -> bool:
    """Constant-time comparison against every key (no early exit on the first match)."""
    if token is None:
        return False
    found = False
    for key in keys:
        found |= hmac.compare_digest(token, key.encode())
    return found


# ----- OpenAI endpoints ---------------------------------------------------------------------------
def api_key_allowed(authorization: str | bytes | None) -> bool:
    """True when no API key is configured, or the header carries one of them."""
    keys = configured_keys("API_KEYS")
    return not keys or key_matches(bearer_token(authorization), keys)


def scope_authorization(scope) -> bytes | None:
    """The Authorization header of an ASGI HTTP scope."""
    for name, value in scope.get("headers") or ():
        if name.lower() == b"authorization":
            return value
    return None


def invalid_api_key_response() -> JsonResponse:
    return error_response(401, *INVALID_API_KEY)


# ----- fleet mutations ----------------------------------------------------------------------------
async def admin_refusal(request) -> JsonResponse | None:
    """None when ``request`` may change the fleet, else the 401/403 answer.

    A Bearer header is judged on its own (a wrong key is 401 even with a session). Without one,
    a logged-in staff user passes if the CSRF check passes (these views are csrf_exempt for API
    clients, so the check runs here, for session-authenticated requests only)."""
    authorization = request.headers.get("Authorization")
    if authorization:
        if key_matches(bearer_token(authorization), configured_keys("ADMIN_KEYS")):
            return None
        return error_response(401, "Incorrect admin key provided.", "authentication_error")
    user = await request.auser() if hasattr(request, "auser") else None
    if user is None or not user.is_authenticated:
        return error_response(
            401,
            "Changing workers needs 'Authorization: Bearer <admin key>' (CONTROL_PLANE_ADMIN_KEYS "
            "or runrouter --admin-key) or a staff session.",
            "authentication_error",
        )
    if not (user.is_active and user.is_staff):
        return error_response(403, "Only staff users may change workers.", "invalid_request_error")
    if CsrfViewMiddleware(lambda r: None).process_view(request, None, (), {}) is not None:
        return error_response(
            403,
            "CSRF verification failed: send the csrftoken cookie's value as the X-CSRFToken "
            "header.",
            "invalid_request_error",
        )
    return None


def admin_required(view):
    """For async views: non-safe methods (POST, DELETE, …) need an admin key or a staff session;
    GET/HEAD/OPTIONS pass untouched (the fleet's reads are open)."""

    @wraps(view)
    async def wrapper(request, *args, **kwargs):
        if request.method not in SAFE_METHODS:
            refused = await admin_refusal(request)
            if refused is not None:
                return refused
        return await view(request, *args, **kwargs)

    return wrapper
