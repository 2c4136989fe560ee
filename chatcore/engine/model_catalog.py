"""The models a dialog may choose (SPEC H4, PROTOCOL "Models and dialog settings").

What the model server lists (`GET {LLM_BASE_URL}/models`), narrowed to `LLM_MODELS` when set,
kept per process and asked again at most every `MODELS_REFRESH_SECONDS` (5 minutes). A failed
refresh keeps the list it had (logged); with none yet, the list is what the settings name
(`LLM_MODELS`, else the default model). The default model is always a choice: every dialog
that chose none asks it. The demo provider lists itself.

The refresh is a blocking request with a timeout (I3), made on a worker thread by async
callers (`aids`), so a slow model server holds up only the caller that found the list stale.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
from django.conf import settings
from django.utils.translation import gettext as _

from chatcore.common.errors import ChatError
from chatcore.common.llm_models import DEMO_MODEL, default_model
from chatcore.logging import scrub

logger = logging.getLogger(__name__)


class UnknownModel(ChatError):
    """A dialog asked for a model the catalog does not offer (400, PROTOCOL H4)."""

    code = "bad_request"
    http_status = 400


class ModelCatalog:
    def __init__(
        self,
        *,
        base_url: str | None,
        api_key: str = "",
        default: str,
        narrow: list[str] | None = None,
        refresh_seconds: float = 300.0,
        timeout: float = 5.0,
        transport: httpx.BaseTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`base_url` None: the demo provider, which lists only itself."""
        self.base_url = base_url.rstrip("/") if base_url else None
        self.default = default
        self.narrow = list(narrow or [])
        self.refresh_seconds = refresh_seconds
        self._api_key = api_key
        self._timeout = timeout
        self._transport = transport
        self._clock = clock
        self._lock = threading.Lock()
        self._listed: list[str] | None = None
        self._asked_at: float | None = None

    @classmethod
    def for_provider(cls, provider: Any) -> ModelCatalog:
        """The catalog of the model server `provider` talks to (its `base_url` and default
        `model`); a provider without one (the demo) lists itself."""
        cfg = settings.LLM
        base_url = getattr(provider, "base_url", None)
        if not base_url:
            return cls(base_url=None, default=DEMO_MODEL)
        return cls(
            base_url=base_url,
            api_key=cfg["API_KEY"],
            default=getattr(provider, "model", None) or cfg["MODEL"],
            narrow=cfg.get("MODELS") or [],
            refresh_seconds=cfg.get("MODELS_REFRESH_SECONDS", 300),
            timeout=cfg.get("MODELS_TIMEOUT", 5.0),
        )

    @classmethod
    def from_settings(cls) -> ModelCatalog:
        cfg = settings.LLM
        if not cfg["BASE_URL"]:
            return cls(base_url=None, default=DEMO_MODEL)
        return cls(
            base_url=cfg["BASE_URL"],
            api_key=cfg["API_KEY"],
            default=default_model(),
            narrow=cfg.get("MODELS") or [],
            refresh_seconds=cfg.get("MODELS_REFRESH_SECONDS", 300),
            timeout=cfg.get("MODELS_TIMEOUT", 5.0),
        )

    # --- reads ------------------------------------------------------------------------------

    def stale(self) -> bool:
        if self.base_url is None:
            return False
        return self._asked_at is None or self._clock() - self._asked_at >= self.refresh_seconds

    def ids(self) -> list[str]:
        """The model ids offered now, the default first; blocking when the list is stale."""
        if self.base_url is None:
            return [DEMO_MODEL]
        if self.stale():
            with self._lock:
                if self.stale():
                    self._refresh()
        return self._offered()

    async def aids(self) -> list[str]:
        """`ids` for async callers: a stale list is asked for on a worker thread."""
        if self.stale():
            return await asyncio.to_thread(self.ids)
        return self.ids()

    def listing(self, ids: list[str]) -> dict[str, Any]:
        """PROTOCOL `GET /models`: {`items`: [{`id`}], `default`}."""
        return {"items": [{"id": model} for model in ids], "default": self.default}

    def check(self, model: str, ids: list[str]) -> str:
        """`model` when it is one of `ids`, else `UnknownModel` naming where the list comes
        from."""
        if model in ids:
            return model
        if self.base_url is None:
            source = _("the demo provider offers only %(model)s") % {"model": DEMO_MODEL}
        elif self.narrow:
            source = _("the models the model server lists, narrowed by LLM_MODELS")
        else:
            source = _("the models the model server lists (GET /models)")
        raise UnknownModel(
            _("Unknown model %(model)s: choose one of %(source)s (GET /api/v1/models).")
            % {"model": model[:200], "source": source}
        )

    # --- the refresh ------------------------------------------------------------------------

    def _offered(self) -> list[str]:
        listed = self._listed
        if listed is None:
            # Nothing listed yet (the server never answered): what the settings name.
            listed = list(self.narrow)
        elif self.narrow:
            allowed = set(listed)
            listed = [model for model in self.narrow if model in allowed]
        return [self.default] + [model for model in listed if model != self.default]

    def _refresh(self) -> None:
        self._asked_at = self._clock()
        headers = {"Accept": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        try:
            with httpx.Client(timeout=self._timeout, transport=self._transport) as client:
                response = client.get(f"{self.base_url}/models", headers=headers)
                response.raise_for_status()
                data = response.json()
            items = data.get("data") if isinstance(data, dict) else None
            if not isinstance(items, list):
                raise ValueError("no `data` list in the answer")
            ids = [
                str(item["id"])
                for item in items
                if isinstance(item, dict) and isinstance(item.get("id"), str) and item["id"]
            ]
        except (httpx.HTTPError, ValueError) as exc:
            logger.warning(
                "could not list the model server's models; keeping the last list: %s",
                scrub(str(exc)),
            )
            return
        self._listed = sorted(set(ids))


# Catalogs made from the settings, by what they were made from (one in a deployment).
_settings_catalogs: dict[tuple[str, str, tuple[str, ...]], ModelCatalog] = {}
_settings_lock = threading.Lock()


def settings_catalog() -> ModelCatalog:
    """A catalog made from the settings alone, one per process for the same settings: for a
    caller in a process without an engine (the admin under a plain WSGI server); a process
    that runs one asks the engine's (`Engine.models`, `dialog_settings.catalog_for`)."""
    cfg = settings.LLM
    key = (cfg["BASE_URL"], str(cfg["MODEL"]), tuple(cfg.get("MODELS") or ()))
    with _settings_lock:
        catalog = _settings_catalogs.get(key)
        if catalog is None:
            catalog = _settings_catalogs[key] = ModelCatalog.from_settings()
        return catalog
