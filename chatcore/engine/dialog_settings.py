"""A dialog's settings set by its owner (SPEC H4): the REST `PATCH`, the WebSocket `settings`
frame and the admin all come here, so the model is checked against the same catalog."""

from __future__ import annotations

from typing import TYPE_CHECKING

from chatcore.common.dbthreads import on_db
from sessions_app import settings_services
from sessions_app.models import Session

from .model_catalog import ModelCatalog, settings_catalog

if TYPE_CHECKING:
    from .engine import Engine


def catalog_for(engine: Engine | None) -> ModelCatalog:
    """The catalog a caller with `engine` (this process's, or None) checks models against:
    the engine's (`Engine.models`, whose list follows its provider), else, in a process
    without one, one made from the settings."""
    return engine.models if engine is not None else settings_catalog()


async def dialog_settings_update(
    *,
    engine: Engine | None,
    session: Session,
    model: str | None = None,
    system_prompt: str | None = None,
) -> Session:
    """Set the dialog's model (one the catalog offers, else `UnknownModel`, 400) and/or its
    system prompt; None leaves a field as it is."""
    if model is not None:
        catalog = catalog_for(engine)
        model = catalog.check(model.strip(), await catalog.aids())
    return await on_db(settings_services.session_settings_update)(
        session=session, model=model, system_prompt=system_prompt
    )
