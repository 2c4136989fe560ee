"""A dialog's settings set by its owner (SPEC H4): the REST `PATCH`, the WebSocket `settings`
frame and the admin all come here, so the model is checked against the same catalog."""

from __future__ import annotations

from typing import TYPE_CHECKING

from chatcore.common.dbthreads import on_db
from sessions_app import settings_services
from sessions_app.models import Session

from .model_catalog import ModelCatalog, process_catalog

if TYPE_CHECKING:
    from .engine import Engine


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
        catalog = engine.models if engine is not None else process_catalog()
        model = catalog.check(model.strip(), await catalog.aids())
    return await on_db(settings_services.session_settings_update)(
        session=session, model=model, system_prompt=system_prompt
    )


def model_choices(catalog: ModelCatalog | None = None) -> list[str]:
    """The model ids offered now (blocking when the list is stale: for sync callers)."""
    return (catalog or process_catalog()).ids()
