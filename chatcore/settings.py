"""Django settings. The environment is read here and nowhere else (STYLE 10).

Embedded mode (default): SQLite in WAL mode, in-memory channel layer, background jobs
in-process. Scaled mode: `DATABASE_URL` points at PostgreSQL and `REDIS_URL` at Redis, which
then carries the channel layer and the Celery broker.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import dj_database_url

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("CHAT_VAR_DIR", BASE_DIR / "var"))


def _env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    return raw.strip().lower() in {"1", "true", "yes", "on"}


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    return int(raw) if raw else default


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    return float(raw) if raw else default


def _env_list(name: str, default: str = "") -> list[str]:
    return [item.strip() for item in os.environ.get(name, default).split(",") if item.strip()]


def _env_windows(name: str) -> dict[str, int]:
    """`name=tokens,...` (H4: a context window per model); a malformed entry stops the start."""
    windows: dict[str, int] = {}
    for item in _env_list(name):
        model, sep, tokens = item.rpartition("=")
        if not sep or not model.strip() or not tokens.strip().isdigit():
            raise ValueError(f"{name} takes name=tokens,... (not {item!r})")
        windows[model.strip()] = int(tokens)
    return windows


def _env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    raw = os.environ.get(name, "").strip() or default
    if raw not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, not {raw!r}")
    return raw


DEBUG = _env_bool("DJANGO_DEBUG", False)
# A dev-safe key for embedded mode; deployments set DJANGO_SECRET_KEY. `serve` refuses to
# listen beyond loopback with this one (F8).
DEV_SECRET_KEY = "dev-insecure-key-set-DJANGO_SECRET_KEY-in-production"  # noqa: S105
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "").strip() or DEV_SECRET_KEY
ALLOWED_HOSTS = _env_list("DJANGO_ALLOWED_HOSTS", "127.0.0.1,localhost,testserver")
# Origins (scheme://host[:port]) trusted besides the site's own: Django's CSRF check and the
# cookie WebSocket's Origin check (F8) both use them, e.g. the public https:// origin of a
# deployment behind a TLS proxy.
CSRF_TRUSTED_ORIGINS = _env_list("DJANGO_CSRF_TRUSTED_ORIGINS")

# --- Behind TLS (F8) ------------------------------------------------------------------------
# Cookies only over https.
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = _env_bool("DJANGO_SECURE_COOKIES", False)
# Strict-Transport-Security max-age; sent on https responses only (0 = off).
SECURE_HSTS_SECONDS = _env_int("DJANGO_HSTS_SECONDS", 0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = _env_bool("DJANGO_HSTS_INCLUDE_SUBDOMAINS", False)
# A TLS-terminating proxy in front sets X-Forwarded-Proto; trust it only when it always does.
if _env_bool("DJANGO_TRUST_X_FORWARDED_PROTO", False):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
# H5: the client address of audit records. Behind that trusted proxy, the last address it
# appended to X-Forwarded-For; otherwise the connection's peer.
TRUST_X_FORWARDED_FOR = _env_bool(
    "DJANGO_TRUST_X_FORWARDED_FOR", _env_bool("DJANGO_TRUST_X_FORWARDED_PROTO", False)
)
SECURE_CONTENT_TYPE_NOSNIFF = True
# Pages run only this site's scripts (no inline script) and are never framed.
CONTENT_SECURITY_POLICY = {
    "default-src": "'self'",
    "script-src": "'self'",
    "style-src": "'self' 'unsafe-inline'",
    "img-src": "'self' data:",
    "connect-src": "'self'",
    "object-src": "'none'",
    "base-uri": "'self'",
    "form-action": "'self'",
    "frame-ancestors": "'none'",
}

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "ninja",
    # F8: failed logins (web and admin) are logged and throttled per user and address.
    "axes",
    "sessions_app",
    "audit",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "chatcore.security.ContentSecurityPolicyMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.locale.LocaleMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # Last, as django-axes asks: it answers a locked-out login with `registration/locked_out`.
    "axes.middleware.AxesMiddleware",
]

# --- Login throttling (F8, django-axes) -----------------------------------------------------
AUTHENTICATION_BACKENDS = [
    "sessions_app.login_throttle.ThrottledBackend",
    "django.contrib.auth.backends.ModelBackend",
]
# After this many failed logins of one username from one address, that pair is refused
# (429) until the cool-off passes; every failure is logged and kept (admin: Access attempts).
AXES_FAILURE_LIMIT = _env_int("CHAT_LOGIN_FAILURE_LIMIT", 5)
AXES_COOLOFF_TIME = _env_int("CHAT_LOGIN_COOLOFF_MINUTES", 15) / 60  # hours
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
# Behind a proxy that appends the client's address to X-Forwarded-For (deploy/nginx.conf):
# count by that address, not the proxy's. Only when every request comes through the proxy.
TRUST_X_FORWARDED_FOR = _env_bool("DJANGO_TRUST_X_FORWARDED_FOR", False)
AXES_CLIENT_IP_CALLABLE = "sessions_app.login_throttle.client_address"
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_TEMPLATE = "registration/locked_out.html"
# Successful logins are not written to the database (the failures are).
AXES_DISABLE_ACCESS_LOG = True
# No banner at every start; failures are still logged (with what they are counted by).
AXES_VERBOSE = False

ROOT_URLCONF = "chatcore.urls"
ASGI_APPLICATION = "chatcore.asgi.application"

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
                "django.template.context_processors.i18n",
            ],
        },
    },
]

# --- Database -------------------------------------------------------------------------------
DATABASE_URL = os.environ.get("DATABASE_URL", "").strip()
if DATABASE_URL:
    _db: dict[str, Any] = dict(dj_database_url.parse(DATABASE_URL, conn_max_age=0))
else:
    VAR_DIR.mkdir(parents=True, exist_ok=True)
    _db = {"ENGINE": "django.db.backends.sqlite3", "NAME": str(VAR_DIR / "chat.sqlite3")}
if _db["ENGINE"] == "django.db.backends.sqlite3":
    # WAL lets readers run beside the single writer; IMMEDIATE takes the write lock at BEGIN, so
    # two writers queue in SQLite's busy handler instead of failing to upgrade a read lock; a
    # writer waits up to `timeout` seconds for the one before it, then fails "database is
    # locked" (storage retries it, A4).
    _db["OPTIONS"] = {
        "transaction_mode": "IMMEDIATE",
        "timeout": 20,
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }
    # Connections stay open (database threads and request threads alike): opening one costs
    # more than most queries, and closing the last one checkpoints and removes the WAL file.
    _db["CONN_MAX_AGE"] = None
    # A file (not :memory:) so engine threads share it; one per process so runs never collide.
    _db["TEST"] = {"NAME": str(VAR_DIR / f"test-{os.getpid()}.sqlite3")}
elif _db["ENGINE"].startswith("django.db.backends.postgresql"):
    # Django's connection pool (psycopg's): the database threads and request threads borrow a
    # connection per call and give it back, so connections are reused, never opened per turn,
    # and bounded here rather than by the thread count. Each borrow checks its connection, so
    # one the server ended while it sat in the pool is replaced, not handed to a read that has
    # no retry (G5).
    _db["CONN_MAX_AGE"] = 0
    _db["CONN_HEALTH_CHECKS"] = True
    _db.setdefault("OPTIONS", {})["pool"] = {
        "min_size": 2,
        "max_size": _env_int("CHAT_DB_POOL_SIZE", _env_int("CHAT_DB_THREADS", 6) + 6),
        "timeout": 10,
    }
    # Prepared statements for the statements written in SQL that every turn runs
    # (`sessions_app.rows.cursor`, which binds their parameters on the server): a pooled
    # connection prepares one after five runs, and the server parses and plans it once
    # instead of on every turn. The ORM's cursors bind on the client and never prepare.
    # CHAT_DB_PREPARED=0 turns it off, for a pooler in transaction mode (PgBouncer without
    # max_prepared_statements), which cannot keep a connection's prepared statements.
    _db["OPTIONS"]["prepare_threshold"] = 5 if _env_bool("CHAT_DB_PREPARED", True) else None
    # One test database per process, so two test runs on one server never collide.
    _db["TEST"] = {"NAME": f"test_{_db['NAME']}_{os.getpid()}"}
DATABASES = {"default": _db}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- Channels and Celery --------------------------------------------------------------------
REDIS_URL = os.environ.get("REDIS_URL", "").strip()
SCALED = bool(REDIS_URL)
# I3: every redis-py client of the platform (the channel layer's, the rate counters', the
# socket registry's, the cache's) waits at most this long to connect and for each reply: a
# stalled Redis answers "no" within seconds instead of holding its callers. A URL's own
# options (`?socket_timeout=...`) win over these.
REDIS_TIMEOUT_SECONDS = float(os.environ.get("CHAT_REDIS_TIMEOUT_SECONDS") or 2.0)
REDIS_OPTIONS: dict[str, Any] = {
    "socket_timeout": REDIS_TIMEOUT_SECONDS,
    "socket_connect_timeout": REDIS_TIMEOUT_SECONDS,
    "socket_keepalive": True,
}
if REDIS_URL:
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "chatcore.common.redislayer.RedisPubSubLayer",
            "CONFIG": {"hosts": [{"address": REDIS_URL, **REDIS_OPTIONS}]},
        }
    }
else:
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "chatcore.common.memlayer.LocalChannelLayer",
            "CONFIG": {"capacity": 1000},
        }
    }

# Rate-limit counters must be shared by every process in scaled mode (F3).
if REDIS_URL:
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": REDIS_URL,
            "OPTIONS": REDIS_OPTIONS,
        }
    }
else:
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}

CELERY_BROKER_URL = REDIS_URL or "memory://"
CELERY_RESULT_BACKEND = None
# G4: a job is acknowledged only when it has run; a worker killed under it gives it back to
# the broker (and another worker runs it: jobs are idempotent); one job at a time per child.
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_TIME_LIMIT = 120
CELERY_TASK_SOFT_TIME_LIMIT = 90
CELERY_TASK_DEFAULT_QUEUE = "chat"
# The longest time limit of any task (`sessions_app.tasks`); Redis hands an unacknowledged
# job to another worker after the visibility timeout, which must exceed it, or a job still
# running would run twice.
CELERY_LONGEST_TASK_SECONDS = 360
# I3: a frozen broker fails a publish within Redis's timeout (kombu waits forever by default).
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": CELERY_LONGEST_TASK_SECONDS + 240,
    **REDIS_OPTIONS,
}
# G5: the broker connection comes back by itself after a Redis restart.
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BROKER_CONNECTION_MAX_RETRIES = None

# --- Auth, i18n, static ---------------------------------------------------------------------
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]
# Keep flash messages (an issued API key is shown once) server-side, not in a cookie.
MESSAGE_STORAGE = "django.contrib.messages.storage.session.SessionStorage"
LOGIN_URL = "/accounts/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/accounts/login/"

LANGUAGE_CODE = "en"
LANGUAGES = [("en", "English"), ("zh-hans", "简体中文")]
LOCALE_PATHS = [BASE_DIR / "locale"]
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "/static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = VAR_DIR / "staticfiles"

# H3: uploaded files go through Django's storage API: a folder under CHAT_VAR_DIR unless
# another backend is configured here (README: S3 through django-storages).
STORAGES: dict[str, Any] = {
    "default": {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": str(VAR_DIR / "files")},
    },
    "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
}

# --- The conversation engine (SPEC A8, F6) --------------------------------------------------
CHAT: dict[str, Any] = {
    "SESSION_TTL_SECONDS": _env_int("CHAT_SESSION_TTL_SECONDS", 24 * 3600),
    "CLEANUP_INTERVAL_SECONDS": _env_int("CHAT_CLEANUP_INTERVAL_SECONDS", 60 * 60),
    "AUTO_TITLE_AFTER": _env_int("CHAT_AUTO_TITLE_AFTER", 10),
    # B4: a first title after the dialog's first completed answer; the threshold's replaces it.
    "FIRST_TITLE": _env_bool("CHAT_FIRST_TITLE", True),
    # B4: seconds before each retry of a failed title (at most this many retries).
    "TITLE_RETRY_DELAYS": [
        float(x) for x in _env_list("CHAT_TITLE_RETRY_DELAYS", "5,20,60") if x.strip()
    ],
    "STORAGE_RETRY_DELAYS_MS": [100, 200, 300],
    "QUEUE_CAPACITY": _env_int("CHAT_QUEUE_CAPACITY", 32),
    "GLOBAL_ADMISSION_BOUND": _env_int("CHAT_GLOBAL_ADMISSION_BOUND", 10_000),
    "RETENTION_DAYS": _env_int("CHAT_RETENTION_DAYS", 30),
    # H5: audit records older than this are purged by the background sweep (0: kept forever).
    "AUDIT_RETENTION_DAYS": _env_int("CHAT_AUDIT_RETENTION_DAYS", 365),
    "CONTENT_LIMIT": _env_int("CHAT_CONTENT_LIMIT", 65_536),
    # H3: one upload's bytes, and the files one send may attach.
    "UPLOAD_MAX_BYTES": _env_int("CHAT_UPLOAD_MAX_BYTES", 20 * 1024 * 1024),
    "ATTACHMENTS_MAX": _env_int("CHAT_ATTACHMENTS_MAX", 10),
    "FRAME_LIMIT_BYTES": _env_int("CHAT_FRAME_LIMIT_BYTES", 256 * 1024),
    "RATE_LIMIT_PER_MINUTE": _env_int("CHAT_RATE_LIMIT_PER_MINUTE", 120),
    "SNAPSHOT_FPS": _env_int("CHAT_SNAPSHOT_FPS", 20),
    # F8: how often each process re-checks the logins of its open sockets and SSE streams
    # (logout, revocation and deactivation also close them at once through the layer).
    "LOGIN_CHECK_SECONDS": _env_int("CHAT_LOGIN_CHECK_SECONDS", 3),
    # F8, issue 57: how long a socket's login lookup (token or session) is reused by the next
    # sockets of that login; with the re-check above, a login ended unannounced in another
    # process closes the sockets opened meanwhile within their sum (5 s).
    "LOGIN_CACHE_SECONDS": _env_int("CHAT_LOGIN_CACHE_SECONDS", 2),
    # Issue 57: the most a user's `sessions` list is kept for the next socket (it is dropped
    # at once on any change announced to the user's chats), and the JSON of the dialogs'
    # newest pages kept for the sockets that open them.
    "SESSIONS_CACHE_SECONDS": _env_int("CHAT_SESSIONS_CACHE_SECONDS", 10),
    "PAGE_CACHE_MAX_BYTES": _env_int("CHAT_PAGE_CACHE_MAX_BYTES", 64 * 1024 * 1024),
    # Issue 57: allocations between two collections of the youngest generation in `serve`
    # (`chatcore.common.heap.settle`; Python's default is 700).
    "GC_YOUNG_THRESHOLD": _env_int("CHAT_GC_YOUNG_THRESHOLD", 20_000),
    "LEASE_SECONDS": _env_int("CHAT_LEASE_SECONDS", 15),
    "CHECKPOINT_SECONDS": 1.0,
    # G6/F7: threads that run the engine's and the async views' database calls side by side.
    "DB_THREADS": _env_int("CHAT_DB_THREADS", 6),
    "MAX_STEPS": _env_int("CHAT_MAX_STEPS", 8),
    "SKILLS_DIR": os.environ.get("CHAT_SKILLS_DIR", str(BASE_DIR / "skills")),
    "EXTRA_TOOLS": [t for t in os.environ.get("CHAT_EXTRA_TOOLS", "").split(",") if t],
    "TOOL_RESULT_TRIM_CHARS": 4000,
    "COMPACTION_BUDGET_RATIO": 0.8,
    "SHUTDOWN_GRACE_SECONDS": 10.0,
    # D4: streaming-message sinks of external platforms, {"channel": "dotted.path.Factory"}.
    "SINKS": {},
    "SINK_RETRIES": 3,
    "SINK_BACKOFF_SECONDS": 0.2,
    "SINK_TIMEOUT_SECONDS": 10.0,
    # D4, C11: how long a platform message left open by a dead process waits after its turn
    # ended before another process closes it, and how often each process looks for such.
    "DELIVERY_ORPHAN_GRACE_SECONDS": _env_int("CHAT_DELIVERY_ORPHAN_GRACE_SECONDS", 5),
    "DELIVERY_RECONCILE_SECONDS": _env_int("CHAT_DELIVERY_RECONCILE_SECONDS", 2),
    # F7 fairness: one user never degrades the others (see README "Configuration").
    "USER_RUNNING_TURNS": _env_int("CHAT_USER_RUNNING_TURNS", 4),
    "MODEL_CALLS_MAX": _env_int("CHAT_MODEL_CALLS_MAX", 256),
    "WRITE_RATE_PER_MINUTE": _env_int("CHAT_WRITE_RATE_PER_MINUTE", 120),
    "USER_SOCKETS_MAX": _env_int("CHAT_USER_SOCKETS_MAX", 20),
    # F4, I3: how long `/healthz` waits for each dependency (they are checked side by side).
    "HEALTH_TIMEOUT_SECONDS": float(os.environ.get("CHAT_HEALTH_TIMEOUT_SECONDS") or 1.5),
    # F3: the largest request body `serve` lets through to Django (413 before reading more).
    "REQUEST_BODY_MAX_BYTES": _env_int("CHAT_REQUEST_BODY_MAX_BYTES", 3 * 1024 * 1024),
    "HISTORY_PAGE_MAX_BYTES": _env_int("CHAT_HISTORY_PAGE_MAX_BYTES", 1024 * 1024),
    "HISTORY_CACHE_MAX_BYTES": _env_int("CHAT_HISTORY_CACHE_MAX_BYTES", 256 * 1024 * 1024),
    "TOKEN_CACHE_ENTRIES": _env_int("CHAT_TOKEN_CACHE_ENTRIES", 500_000),
    "TURN_DEADLINE_SECONDS": _env_int("CHAT_TURN_DEADLINE_SECONDS", 600),
    # F3: one answer's text and tool call bytes; past it the turn fails `too_large`, keeping
    # what arrived up to it.
    "ANSWER_MAX_BYTES": _env_int("CHAT_ANSWER_MAX_BYTES", 2 * 1024 * 1024),
    # Started with each server process's engine (`runtime.start_in_current_loop`): dotted
    # paths of functions taking the engine, which spawn supervised tasks on it.
    "ENGINE_SERVICES": [],
    # H2: the largest document `POST /sessions/import` reads, and messages it takes.
    "IMPORT_MAX_BYTES": _env_int("CHAT_IMPORT_MAX_BYTES", 50 * 1024 * 1024),
    "IMPORT_MAX_MESSAGES": _env_int("CHAT_IMPORT_MAX_MESSAGES", 100_000),
}

# Chat apps (PROTOCOL "Chat apps"): each platform is on only when its credentials are set.
CHATAPPS: dict[str, dict[str, Any]] = {
    "telegram": {
        "BOT_TOKEN": os.environ.get("TELEGRAM_BOT_TOKEN", "").strip(),
        "WEBHOOK_SECRET": os.environ.get("TELEGRAM_WEBHOOK_SECRET", "").strip(),
        "API_BASE": os.environ.get("TELEGRAM_API_BASE", "https://api.telegram.org").rstrip("/"),
        # Telegram allows about one edit a second per chat; a 429 retry_after overrides it.
        "EDIT_INTERVAL_SECONDS": 1.0,
        "POLL_TIMEOUT_SECONDS": 30,
    },
    "feishu": {
        "APP_ID": os.environ.get("FEISHU_APP_ID", "").strip(),
        "APP_SECRET": os.environ.get("FEISHU_APP_SECRET", "").strip(),
        "VERIFICATION_TOKEN": os.environ.get("FEISHU_VERIFICATION_TOKEN", "").strip(),
        "ENCRYPT_KEY": os.environ.get("FEISHU_ENCRYPT_KEY", "").strip(),
        "API_BASE": os.environ.get("FEISHU_API_BASE", "https://open.feishu.cn").rstrip("/"),
        "EDIT_INTERVAL_SECONDS": 1.0,
        # A signed callback older (or newer) than this is refused: a replay (Feishu's advice).
        "MAX_REQUEST_AGE_SECONDS": _env_int("FEISHU_MAX_REQUEST_AGE_SECONDS", 300),
    },
}
if CHATAPPS["telegram"]["BOT_TOKEN"]:
    CHAT["SINKS"]["telegram"] = "sessions_app.chatapps.telegram.TelegramSink"
if CHATAPPS["feishu"]["APP_ID"] and CHATAPPS["feishu"]["APP_SECRET"]:
    CHAT["SINKS"]["feishu"] = "sessions_app.chatapps.feishu.FeishuSink"
if CHAT["SINKS"]:
    # D4, C11: answers a dead process left open are closed from the start, not only once a
    # platform's first message after a restart arrives.
    CHAT["ENGINE_SERVICES"].append("sessions_app.chatapps.start_adapters")

# `make run`: the port to serve on and the demo login it makes sure exists.
PORT = _env_int("PORT", 8000)
DEMO_PASSWORD = os.environ.get("DEMO_PASSWORD") or "demo-password"  # noqa: S105 - local demo

LLM: dict[str, Any] = {
    "BASE_URL": os.environ.get("LLM_BASE_URL", "").strip().rstrip("/"),
    "API_KEY": os.environ.get("LLM_API_KEY", ""),
    "MODEL": os.environ.get("LLM_MODEL", "gpt-4o-mini"),
    "CONTEXT_WINDOW": _env_int("LLM_CONTEXT_WINDOW", 32768),
    # H4: the models offered (what the server lists, narrowed to these when set), the context
    # window of each model that differs from CONTEXT_WINDOW, and how long a list is kept.
    "MODELS": _env_list("LLM_MODELS"),
    "CONTEXT_WINDOWS": _env_windows("LLM_CONTEXT_WINDOWS"),
    "MODELS_REFRESH_SECONDS": 300,
    "MODELS_TIMEOUT": 5.0,
    # I3: seconds to open a connection to the model server, and the longest silence while
    # waiting for its answer (before the first token or between two): past it the turn ends
    # `failed`, keeping what arrived.
    "CONNECT_TIMEOUT": _env_float("LLM_CONNECT_TIMEOUT", 10.0),
    "READ_TIMEOUT": _env_float("LLM_READ_TIMEOUT", 120.0),
    "MAX_RETRIES": 3,
    "RETRY_BASE_DELAY": 0.5,
    # E5: cap on answer tokens per request (0 = what the window leaves after the input), and
    # the request field that carries it (`max_completion_tokens` for OpenAI's newer models).
    "MAX_TOKENS": _env_int("LLM_MAX_TOKENS", 0),
    "MAX_TOKENS_PARAM": _env_choice(
        "LLM_MAX_TOKENS_PARAM", ("max_tokens", "max_completion_tokens"), "max_tokens"
    ),
    # STYLE 6: no cap on concurrent connections (CHAT_MODEL_CALLS_MAX bounds the calls), a
    # small keep-alive pool, and a short wait for a pooled connection.
    "MAX_KEEPALIVE_CONNECTIONS": _env_int("LLM_MAX_KEEPALIVE_CONNECTIONS", 10),
    "POOL_TIMEOUT": _env_float("LLM_POOL_TIMEOUT", 5.0),
    # F3, I3: how much of a model server's answer is read: one server-sent event line, the
    # decompressed stream (bytes, and ratio to what arrived), the start of an error body.
    "MAX_EVENT_BYTES": _env_int("LLM_MAX_EVENT_BYTES", 1024 * 1024),
    "MAX_DECODED_BYTES": _env_int("LLM_MAX_DECODED_BYTES", 64 * 1024 * 1024),
    "MAX_DECODE_RATIO": _env_int("LLM_MAX_DECODE_RATIO", 200),
    "MAX_ERROR_BODY_BYTES": _env_int("LLM_MAX_ERROR_BODY_BYTES", 64 * 1024),
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "structured": {"()": "chatcore.logging.StructuredFormatter"},
    },
    "handlers": {
        "console": {"class": "logging.StreamHandler", "formatter": "structured"},
    },
    "root": {"handlers": ["console"], "level": os.environ.get("LOG_LEVEL", "INFO")},
    "loggers": {
        "django.db.backends": {"level": "WARNING"},
        "httpx": {"level": "WARNING"},
        "httpcore": {"level": "WARNING"},
        "daphne": {"level": "WARNING"},
    },
}

# Scaled mode: periodic sweeps run on Celery beat (`celery -A chatcore beat`); embedded mode
# runs the same sweeps from the engine's supervisor (A6, A7).
CELERY_BEAT_SCHEDULE: dict[str, Any] = {
    "purge-deleted-dialogs": {
        "task": "sessions_app.tasks.purge_deleted_sessions",
        "schedule": float(CHAT["CLEANUP_INTERVAL_SECONDS"]),
    },
    "evict-idle-session-state": {
        "task": "sessions_app.tasks.evict_idle_session_states",
        "schedule": float(CHAT["CLEANUP_INTERVAL_SECONDS"]),
    },
}
