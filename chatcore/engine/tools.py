"""Tools the model may call (C8): a registry whose JSON schemas are derived from typed Python
functions, a few safe built-ins, and extra tools named in settings (`CHAT["EXTRA_TOOLS"]`,
dotted paths to functions decorated with `@tool` or plain typed functions).

A tool gets a `ToolContext` (owner and dialog, never platform sender ids) and its arguments;
it returns text. Errors become an error result for the model, never a failed turn.
"""

from __future__ import annotations

import inspect
import json
import logging
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import import_module
from typing import Any

from django.conf import settings

from chatcore.common.dbthreads import on_db

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ToolContext:
    owner_id: int
    session_pk: str


ToolFn = Callable[..., Any]

_JSON_TYPES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


def _schema_for(annotation: Any) -> dict[str, Any]:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _schema_for(args[0]) if args else {"type": "string"}
    if origin is list:
        (item,) = typing.get_args(annotation) or (str,)
        return {"type": "array", "items": _schema_for(item)}
    if origin is typing.Literal:
        return {"type": "string", "enum": list(typing.get_args(annotation))}
    return {"type": _JSON_TYPES.get(annotation, "string")}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    fn: ToolFn
    parameters: dict[str, Any]

    @classmethod
    def from_function(cls, fn: ToolFn, *, name: str | None = None) -> Tool:
        hints = typing.get_type_hints(fn)
        props: dict[str, Any] = {}
        required: list[str] = []
        doc = inspect.getdoc(fn) or ""
        arg_docs = _arg_docs(doc)
        for pname, param in inspect.signature(fn).parameters.items():
            if pname == "ctx":
                continue
            schema = _schema_for(hints.get(pname, str))
            if pname in arg_docs:
                schema["description"] = arg_docs[pname]
            props[pname] = schema
            if param.default is inspect.Parameter.empty:
                required.append(pname)
        return cls(
            name=name or fn.__name__,
            description=doc.split("\n\n", 1)[0].strip(),
            fn=fn,
            parameters={"type": "object", "properties": props, "required": required},
        )

    def as_openai(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


def _arg_docs(doc: str) -> dict[str, str]:
    """`name: text` lines after an `Args:` heading."""
    out: dict[str, str] = {}
    in_args = False
    for line in doc.splitlines():
        if line.strip().lower() == "args:":
            in_args = True
            continue
        if in_args and ":" in line and line.startswith((" ", "\t")):
            key, _, text = line.strip().partition(":")
            out[key.strip()] = text.strip()
    return out


class ToolRegistry:
    def __init__(self, tools: list[Tool] | None = None) -> None:
        self._tools: dict[str, Tool] = {}
        for t in tools or []:
            self.add(t)

    def add(self, tool: Tool) -> None:
        self._tools[tool.name] = tool

    def names(self) -> list[str]:
        return list(self._tools)

    def schemas(self) -> list[dict[str, Any]]:
        return [t.as_openai() for t in self._tools.values()]

    async def call(self, name: str, arguments: str, ctx: ToolContext) -> tuple[bool, str]:
        """Run a tool; returns (ok, text for the model)."""
        tool = self._tools.get(name)
        if tool is None:
            return False, f"error: unknown tool {name!r}"
        try:
            args = json.loads(arguments or "{}")
            if not isinstance(args, dict):
                raise ValueError("arguments must be a JSON object")
        except ValueError as exc:
            return False, f"error: invalid arguments: {exc}"
        try:
            if inspect.iscoroutinefunction(tool.fn):
                result = await tool.fn(ctx, **args)
            else:
                result = await on_db(tool.fn)(ctx, **args)
        except TypeError as exc:
            return False, f"error: {exc}"
        except Exception:
            logger.exception("tool %s failed", name, extra={"session_id": ctx.session_pk})
            return False, "error: the tool failed"
        return True, result if isinstance(result, str) else json.dumps(result, default=str)


_DECORATED: dict[str, Tool] = {}


def tool(fn: ToolFn) -> ToolFn:
    """Mark a typed function `(ctx, ...)` as a tool; its docstring describes it."""
    _DECORATED[f"{fn.__module__}.{fn.__qualname__}"] = Tool.from_function(fn)
    return fn


# --- Built-ins ----------------------------------------------------------------------------


def current_time(ctx: ToolContext) -> str:
    """Get the current date and time in UTC."""
    return datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def remember(ctx: ToolContext, note: str) -> str:
    """Save a short note about the user to memory, kept across dialogs.

    Args:
        note: the fact to remember, in one sentence
    """
    from sessions_app import turn_services

    note = note.strip()[:2000]
    if not note:
        return "error: empty note"
    turn_services.memory_note_add(owner_id=ctx.owner_id, content=note)
    return "saved"


def recall(ctx: ToolContext, query: str = "") -> str:
    """Search the notes saved with `remember`.

    Args:
        query: words to look for; empty lists the latest notes
    """
    from sessions_app.models import MemoryNote

    qs = MemoryNote.objects.filter(owner_id=ctx.owner_id)
    if query.strip():
        qs = qs.filter(content__icontains=query.strip())
    notes = list(qs.order_by("-created_at").values_list("content", flat=True)[:20])
    return "\n".join(f"- {n}" for n in notes) if notes else "no notes"


def plan_update(ctx: ToolContext, plan: str) -> str:
    """Replace this dialog's working plan (a short checklist the assistant keeps).

    Args:
        plan: the full new plan text; empty clears it
    """
    from sessions_app import turn_services

    turn_services.session_plan_set(session_pk=ctx.session_pk, plan=plan.strip()[:8000])
    return "plan updated"


def plan_read(ctx: ToolContext) -> str:
    """Read this dialog's working plan."""
    from sessions_app.models import Session

    plan = Session.objects.filter(pk=ctx.session_pk).values_list("plan", flat=True).first()
    return plan or "no plan"


BUILTINS: list[ToolFn] = [current_time, remember, recall, plan_update, plan_read]


def _load_extra(path: str) -> Tool:
    module_name, _, attr = path.rpartition(".")
    fn = getattr(import_module(module_name), attr)
    return _DECORATED.get(f"{fn.__module__}.{fn.__qualname__}") or Tool.from_function(fn)


def registry_from_settings() -> ToolRegistry:
    registry = ToolRegistry([Tool.from_function(fn) for fn in BUILTINS])
    for path in settings.CHAT["EXTRA_TOOLS"]:
        registry.add(_load_extra(path))
    return registry
