"""Response schemas of search and share links (PROTOCOL "Search, export, import")."""

from __future__ import annotations

from ninja import Field, Schema

from .schemas import Timestamp


class SearchHitOut(Schema):
    session_id: str
    dialog_id: str
    title: str
    seq: int | None = Field(description="The message to open; null for a title hit.")
    role: str = Field(description="`user`, `assistant`, or `title` for a title hit.")
    snippet: str = Field(description="Plain text around the first match.")
    highlights: list[list[int]] = Field(
        description="[start, end) spans of `snippet` that match, in Unicode code points."
    )
    created_at: Timestamp


class SearchOut(Schema):
    items: list[SearchHitOut]
    count: int = Field(description="How many hits there are, over all pages.")


class ShareOut(Schema):
    share_id: str
    session_id: str
    title: str = Field(description="The dialog's title when the link was made.")
    url: str = Field(description="`/s/{share_id}`: the read-only page, no login needed.")
    created_at: Timestamp
