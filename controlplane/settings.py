"""Django settings for the control plane. Every value that differs between machines comes
from the environment; the defaults give the embedded mode (SQLite, in-memory channel layer,
eager Celery) that needs nothing installed.
"""

import os
import warnings
from pathlib import Path

from controlplane.env import (
    channel_layers,
    env_bool,
    env_list,
    namespaced_settings,
    parse_database_url,
    sqlite_database,
)

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = BASE_DIR / "var"

_DEV_SECRET_KEY = "django-insecure-dev-only-key-do-not-use-in-production"
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", _DEV_SECRET_KEY)
DEBUG = env_bool(os.environ, "DJANGO_DEBUG", False)
ALLOWED_HOSTS = env_list(os.environ, "DJANGO_ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]"])

if not DEBUG and SECRET_KEY == _DEV_SECRET_KEY:
    # Fine on a laptop; anyone who can read this file can forge sessions on a shared host.
    warnings.warn(
        "DJANGO_SECRET_KEY is unset and DEBUG is off: using the public development key. "
        "Set DJANGO_SECRET_KEY before exposing the control plane.",
        RuntimeWarning,
        stacklevel=1,
    )

INSTALLED_APPS = [
    # daphne first: its runserver replaces Django's so the dev server speaks ASGI.
    "daphne",
    "channels",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "apps.replicas",
    "apps.routing",
]

# All stock middleware is async-capable, so the streaming proxy path stays on the event loop.
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "controlplane.urls"
ASGI_APPLICATION = "controlplane.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]


def _default_database() -> dict:
    """SQLite under ``var/``, created on first use so a fresh clone needs no set-up."""
    VAR_DIR.mkdir(exist_ok=True)
    return sqlite_database(str(VAR_DIR / "db.sqlite3"))


_DATABASE_URL = os.environ.get("DATABASE_URL", "").strip()
DATABASES = {
    "default": parse_database_url(_DATABASE_URL, base_dir=BASE_DIR)
    if _DATABASE_URL
    else _default_database()
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# Redis is optional: it shares the channel layer, the Celery broker and the digest index
# between several control-plane processes. Without it everything stays in-process.
REDIS_URL = os.environ.get("REDIS_URL", "").strip() or None
CHANNEL_LAYERS = channel_layers(REDIS_URL)

CELERY_BROKER_URL = REDIS_URL or "memory://"
CELERY_RESULT_BACKEND = REDIS_URL or "cache+memory://"
# Embedded mode: no broker, so tasks run inline where they are sent.
CELERY_TASK_ALWAYS_EAGER = REDIS_URL is None
CELERY_TASK_EAGER_PROPAGATES = True

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"

# The control plane's own knobs, one namespace; each key is overridable as
# CONTROL_PLANE_<KEY> (e.g. CONTROL_PLANE_POLICY=round_robin). Defaults follow SGLang's router.
CONTROL_PLANE = namespaced_settings(
    os.environ,
    "CONTROL_PLANE_",
    {
        "POLICY": "cache_aware",
        "CACHE_THRESHOLD": 0.3,
        "BALANCE_ABS_THRESHOLD": 64,
        "BALANCE_REL_THRESHOLD": 1.5,
        # cache_aware's choice checked against the learned time model (docs/routing.md, "The
        # time model"); CONTROL_PLANE_TIME_CHECK=false routes by the policy's token costs alone
        "TIME_CHECK": True,
        "HEALTH_CHECK_INTERVAL_S": 10.0,
        "REQUEST_TIMEOUT_S": 600.0,
        # Access control. Comma-separated lists; empty means none configured.
        # ADMIN_KEYS: Bearer keys for the /workers mutations (besides a staff session).
        # API_KEYS: Bearer keys the OpenAI endpoints require (empty: open, like vLLM without
        # --api-key).
        "ADMIN_KEYS": "",
        "API_KEYS": "",
        # Periodic jobs (apps/routing/tasks.py): in the router process without a broker, or Celery
        # worker + beat when REDIS_URL is set.
        "SCRAPE_INTERVAL_S": 2.0,
        "DISCOVERY_REFRESH_INTERVAL_S": 60.0,
        "PRUNE_INTERVAL_S": 600.0,
        "SAMPLE_RETENTION_S": 86400.0,
        "EVENT_RETENTION_S": 7 * 86400.0,
        "DASHBOARD_WINDOW_S": 600.0,
        # With REDIS_URL: router processes publish their prefix-index inserts and load to each
        # other.
        "SHARE_INDEX": True,
        # Follow the KV events of engines that publish them (ours: GET /kv_events) into the index.
        "KV_EVENTS": True,
        # At discovery, check per path that a dp-aware worker serves a pinned request on that rank
        # (apps/replicas/pin_check.py: one 1-token request per rank and path).
        "PIN_CHECK": True,
        # Send the engine a completion's text prompt as the token ids the router made of it: to
        # ours beside the text, to a vLLM in its place once its /tokenize agrees with them
        # (apps/routing/feeds/prompt_ids.py).
        "PROMPT_IDS": True,
        # Admission control per router process (apps/routing/proxy/admission.py; runrouter's flags
        # of the same names win): 0 = no concurrency limit / saturation rule off. smg's queue
        # defaults.
        "MAX_CONCURRENT_REQUESTS": 0,
        "QUEUE_SIZE": 100,
        "QUEUE_TIMEOUT_S": 60.0,
        "SATURATION_QUEUED_PREFILL_TOKENS": 0,
        "SATURATION_KV_USAGE": 0.0,
        # Per-tenant rate limits (apps/routing/proxy/tenants.py): "TENANT=RPM[:TPM],..." and
        # "RPM[:TPM]" for every other tenant; empty: none.
        "TENANT_LIMITS": "",
        "DEFAULT_TENANT_LIMIT": "",
        # A request without a cache_salt gets its tenant as one (apps/routing/proxy/tenants.py).
        "TENANT_CACHE_SALT": False,
        # On SIGTERM/SIGINT: how long in-flight requests may run on (apps/routing/proxy/drain.py).
        "DRAIN_TIMEOUT_S": 25.0,
        # The ASGI server a router process runs under (apps/routing/process.py): uvicorn or
        # daphne (runrouter --server wins); why uvicorn: docs/benchmarks.md, "The ASGI server".
        "SERVER": "uvicorn",
        # A client's request line and headers (uvicorn), and its body, must arrive within these
        # (serving/uvicorn_server.py, serving/asgi.py read_body).
        "HEADER_TIMEOUT_S": 20.0,
        "BODY_TIMEOUT_S": 30.0,
    },
)

LOG_LEVEL = os.environ.get("DJANGO_LOG_LEVEL", "INFO").upper()
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"},
    },
    "handlers": {
        "stderr": {
            "class": "logging.StreamHandler",
            "formatter": "plain",
            "stream": "ext://sys.stderr",
        },
    },
    "root": {"handlers": ["stderr"], "level": LOG_LEVEL},
    "loggers": {
        # Django's own loggers carry their handlers; route them through ours instead so
        # every line has the same format.
        "django": {"handlers": ["stderr"], "level": LOG_LEVEL, "propagate": False},
        # one line per proxied request is noise (and costs time on the hot path)
        "httpx": {"level": "WARNING"},
        # a line per 4xx/5xx answer (every refused request, every 503 /health) is noise
        "django.request": {"level": "ERROR"},
        "httpcore": {"level": "WARNING"},
    },
}
