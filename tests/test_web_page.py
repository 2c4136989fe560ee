"""The web chat page as Django serves it (E1): login required, the template with its config,
the vendored renderer and sanitiser, the static files it loads."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from django.contrib.staticfiles import finders
from django.test import Client
from django.urls import reverse

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parent.parent

SCRIPTS = (
    "vendor/marked/marked.umd.js",
    "vendor/dompurify/purify.min.js",
    "vendor/highlight/highlight.min.js",
    "chat/history.js",
    "chat/app.js",
)


def _config(html: str) -> dict[str, Any]:
    match = re.search(
        r'<script id="chat-config" type="application/json">(.*?)</script>', html, re.S
    )
    assert match, "the page has no json_script config"
    return json.loads(match.group(1))


def test_anonymous_user_is_sent_to_login(client: Client) -> None:
    # covers: E1, F2
    response = client.get("/")

    assert response.status_code == 302
    assert response["Location"].startswith(reverse("login"))
    assert "next=/" in response["Location"]


def test_chat_url_is_the_root(client: Client) -> None:
    assert reverse("chat") == "/"


def test_page_renders_for_a_logged_in_user(client: Client, make_user: Any) -> None:
    # covers: E1
    user = make_user("carol")
    user.first_name = "Carol"
    user.last_name = "<Smith>"
    user.save()
    client.force_login(user)

    response = client.get("/")

    assert response.status_code == 200
    assert response["Cache-Control"].startswith("max-age=0")
    html = response.content.decode()
    for script in SCRIPTS:
        assert f'src="/static/{script}"' in html
    # Sanitiser before the app, renderer before both.
    positions = [html.index(f"/static/{script}") for script in SCRIPTS]
    assert positions == sorted(positions)
    assert 'href="/static/chat/chat.css"' in html
    assert 'name="csrfmiddlewaretoken"' in html  # the sign-out form
    assert "csrftoken" in response.cookies
    # The display name is escaped in the page and carried safely in the config.
    assert "Carol &lt;Smith&gt;" in html
    assert "<Smith>" not in html.split('id="chat-config"')[0]
    config = _config(html)
    assert config["ws_path"] == "/ws/chat/"
    assert config["login_url"] == reverse("login")
    assert config["csrf_token"]
    assert config["user"] == {"username": "carol", "display_name": "Carol <Smith>"}
    assert config["content_limit"] > 0
    strings = config["strings"]
    for key in ("connected", "reconnecting", "stop", "retry", "queued", "rename", "delete"):
        assert strings[key], key
    # Landmarks and labelled controls the browser tests and screen readers rely on.
    for element_id in (
        "sidebar",
        "dialog-list",
        "new-dialog",
        "menu-button",
        "chat-title",
        "conn-status",
        "stop-button",
        "transcript",
        "composer-input",
        "send-button",
        "live-status",
    ):
        assert f'id="{element_id}"' in html, element_id
    assert 'aria-live="polite"' in html
    assert '<label for="composer-input"' in html


def test_page_strings_follow_the_language(client: Client, make_user: Any) -> None:
    # covers: F5
    client.force_login(make_user("dora"))

    response = client.get("/", HTTP_ACCEPT_LANGUAGE="zh-hans")

    assert response.status_code == 200
    html = response.content.decode()
    assert '<html lang="zh-hans">' in html
    assert _config(html)["language"] == "zh-hans"


def test_static_files_exist() -> None:
    for script in (*SCRIPTS, "chat/chat.css", "chat/base.css"):
        assert finders.find(script), script
    vendor = ROOT / "static" / "vendor"
    assert (vendor / "README.md").is_file()
    assert (vendor / "marked" / "LICENSE").is_file()
    assert (vendor / "dompurify" / "LICENSE").is_file()
    readme = (vendor / "README.md").read_text()
    assert "marked" in readme and "dompurify" in readme
    # The vendored builds are the browser (UMD) ones, with their banners intact.
    assert "marked v" in (vendor / "marked" / "marked.umd.js").read_text()[:300]
    assert "DOMPurify" in (vendor / "dompurify" / "purify.min.js").read_text()[:300]
    # Issue 54: highlight.js's browser build and its two themes.
    assert (vendor / "highlight" / "LICENSE").is_file() and "highlight/" in readme
    assert "Highlight.js v" in (vendor / "highlight" / "highlight.min.js").read_text()[:300]
    for theme in ("github.min.css", "github-dark.min.css"):
        assert finders.find(f"vendor/highlight/{theme}"), theme


def test_app_never_writes_unsanitised_html() -> None:
    # E1: model output is untrusted. The app builds DOM nodes; the only HTML it inserts is
    # DOMPurify's fragment, so no module has innerHTML/outerHTML/insertAdjacentHTML writes.
    modules = sorted((ROOT / "static" / "chat").glob("*.js"))
    assert len(modules) > 2, modules
    for module in modules:
        source = module.read_text()
        for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write"):
            assert sink not in source, (module.name, sink)
    source = (ROOT / "static" / "chat" / "markdown.js").read_text()
    assert "purifier.sanitize(" in source
    assert "RETURN_DOM_FRAGMENT: true" in source


def _module_imports(name: str) -> list[str]:
    source = (ROOT / "static" / "chat" / name).read_text()
    return re.findall(r'^import \{[^}]*\} from "\./([\w.]+)";$', source, re.M)


def test_page_modules_import_one_way() -> None:
    # covers: E1 (the page's ES modules: every import found, no circle, each module small)
    seen: dict[str, list[str]] = {}
    # Two pages: the chat (app.js) and a share link's public page (share.js, H2).
    todo = ["app.js", "share.js"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        assert finders.find(f"chat/{name}"), name
        seen[name] = _module_imports(name)
        todo.extend(seen[name])
    # Every module in static/chat/ is reached from a page (history.js is a classic script).
    on_disk = {path.name for path in (ROOT / "static" / "chat").glob("*.js")}
    assert set(seen) == on_disk - {"history.js"}
    assert {"transport.js", "state.js", "render.js", "sidebar.js", "composer.js"} <= set(seen)

    def reaches(start: str, goal: str) -> bool:
        stack, visited = list(seen[start]), set()
        while stack:
            name = stack.pop()
            if name == goal:
                return True
            if name not in visited:
                visited.add(name)
                stack.extend(seen[name])
        return False

    for name in seen:
        assert not reaches(name, name), f"{name} imports itself through a circle"
    # The data modules touch no DOM and import no DOM module.
    for name in ("format.js", "state.js"):
        source = (ROOT / "static" / "chat" / name).read_text()
        assert "document." not in source, name
        assert set(seen[name]) <= {"format.js"}, name
    for name in seen:
        lines = len((ROOT / "static" / "chat" / name).read_text().splitlines())
        assert lines < 500, (name, lines)
