"""The audit trail as an operator reads it, in a real headless Chromium (H5): a rename typed in
the web chat appears in the admin's audit list, reached by keyboard from the dialog's page
on a phone-sized screen, and the list offers no way to change a record."""

# ruff: noqa: F811 - the imported fixtures are requested by name as test arguments

from __future__ import annotations

import re
from typing import Any

import pytest
from playwright.sync_api import expect

from tests.browser import (  # noqa: F401 - the shared fixtures
    Served,
    Tab,
    _screenshot,
    browser,
    context,
    model,
    served,
    tab,
)

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def test_a_rename_in_the_chat_is_in_the_dialog_s_audit_trail(
    tab: Tab, browser: Any, served: Served
) -> None:
    # covers: H5, E2
    dialog_id = tab.current_dialog()
    tab.send("/rename Audited trip")
    expect(tab.page.locator(".dialog-item.is-current")).to_contain_text("Audited trip")

    # The operator (the demo user is a superuser) on a phone, in the same session.
    phone = browser.new_context(
        viewport={"width": 390, "height": 844},
        base_url=served.base,
        storage_state=tab.page.context.storage_state(),
    )
    try:
        page = phone.new_page()
        # The most recently active dialog comes first in the list.
        page.goto(served.base + "/admin/sessions_app/session/")
        page.get_by_role("link", name=re.compile(r"web:.*:" + re.escape(dialog_id))).click()
        link = page.get_by_role("link", name="Audit trail")
        link.focus()
        page.keyboard.press("Enter")
        page.wait_for_url(re.compile(r"/admin/audit/auditevent/\?target_type=dialog"))
        rows = page.locator("#result_list tbody tr")
        expect(rows).to_have_count(1)
        expect(rows.first).to_contain_text("dialog renamed")
        expect(rows.first).to_contain_text("demo")
        expect(rows.first).to_contain_text('"new": "Audited trip"')
        expect(rows.first).to_contain_text('"via": "websocket"')
        # Read-only: no add button, no actions, and the record's page has no save button.
        expect(page.locator(".object-tools .addlink")).to_have_count(0)
        expect(page.locator("select[name=action]")).to_have_count(0)
        rows.first.locator("th a").click()
        expect(page.locator(".readonly").first).to_be_visible()
        expect(page.locator("input[name=_save]")).to_have_count(0)
        _screenshot(page, "audit-record-phone.png")
    finally:
        phone.close()
