"""English and Chinese user-visible text (SPEC F5): chosen by Accept-Language or by the user's
own setting (Django's set_language view), in pages, slash commands and error messages, and a
Chinese catalog that is complete, compiled and keeps every placeholder intact."""

# covers: F5

from __future__ import annotations

import gettext
import re
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.utils import translation

from chatcore.common import errors
from chatcore.common.errors import QueueFull, UnknownCommand
from chatcore.engine.commands import REGISTRY, CommandContext, run_command
from sessions_app.web import js_strings

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parent.parent
CATALOG = ROOT / "locale" / "zh_Hans" / "LC_MESSAGES"
PO_PATH = CATALOG / "django.po"
MO_PATH = CATALOG / "django.mo"

HAN = re.compile(r"[\u4e00-\u9fff]")
# Python %-format placeholders (%(name)s, %(n)d, %(type)r, %%) and str.format fields ({x}).
PLACEHOLDER = re.compile(r"%\(\w+\)[sdifr]|%%|%[sdifr]|\{\w*\}")
SLASH_COMMAND = re.compile(r"(?<![\w/])/[a-z]+\b")


def has_chinese(text: str) -> bool:
    return bool(HAN.search(text))


# --- a tiny .po reader --------------------------------------------------------------------


def _unquote(literal: str) -> str:
    body = literal.strip()
    assert body.startswith('"') and body.endswith('"'), literal
    escapes = {"n": "\n", "t": "\t", '"': '"', "\\": "\\"}
    return re.sub(r"\\(.)", lambda m: escapes[m.group(1)], body[1:-1])


def read_po(path: Path) -> list[dict[str, Any]]:
    """Entries of a .po file as dicts: msgid, msgid_plural, msgstr / msgstr[N], flags.
    Obsolete (`#~`) entries are skipped."""
    entries: list[dict[str, Any]] = []
    for block in path.read_text(encoding="utf-8").split("\n\n"):
        entry: dict[str, Any] = {"flags": set()}
        key = ""
        for line in block.strip().splitlines():
            if line.startswith("#,"):
                entry["flags"] |= {flag.strip() for flag in line[2:].split(",")}
            elif line.startswith("#"):
                continue
            elif line.startswith('"'):
                entry[key] += _unquote(line)
            else:
                key, _sep, rest = line.partition(" ")
                entry[key] = _unquote(rest)
        if "msgid" in entry:
            entries.append(entry)
    return entries


def translations_of(entry: dict[str, Any]) -> list[str]:
    if "msgid_plural" in entry:
        return [value for key, value in sorted(entry.items()) if key.startswith("msgstr[")]
    return [entry.get("msgstr", "")]


@pytest.fixture(scope="module")
def po_entries() -> list[dict[str, Any]]:
    return read_po(PO_PATH)


@pytest.fixture(scope="module")
def messages(po_entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every entry but the header."""
    return [entry for entry in po_entries if entry["msgid"]]


# --- the catalog --------------------------------------------------------------------------


def test_po_header_declares_chinese_utf8_and_one_plural_form(
    po_entries: list[dict[str, Any]],
) -> None:
    header = next(entry for entry in po_entries if entry["msgid"] == "")
    fields = dict(line.split(": ", 1) for line in header["msgstr"].splitlines() if ": " in line)

    assert fields["Language"] == "zh_Hans"
    assert fields["Content-Type"] == "text/plain; charset=UTF-8"
    assert fields["Plural-Forms"] == "nplurals=1; plural=0;"
    assert "fuzzy" not in header["flags"]


def test_every_msgid_has_a_chinese_translation(messages: list[dict[str, Any]]) -> None:
    assert len(messages) > 100, "the catalog looks truncated"
    untranslated = [e["msgid"] for e in messages if not all(translations_of(e))]
    fuzzy = [e["msgid"] for e in messages if "fuzzy" in e["flags"]]
    not_chinese = [e["msgid"] for e in messages if not all(map(has_chinese, translations_of(e)))]

    assert untranslated == []
    assert fuzzy == []
    assert not_chinese == []


def test_plural_entries_fill_exactly_the_one_chinese_form(messages: list[dict[str, Any]]) -> None:
    plurals = [entry for entry in messages if "msgid_plural" in entry]

    assert plurals
    for entry in plurals:
        forms = sorted(key for key in entry if key.startswith("msgstr"))
        assert forms == ["msgstr[0]"], entry["msgid"]


def test_translations_keep_placeholders_and_slash_commands(
    messages: list[dict[str, Any]],
) -> None:
    for entry in messages:
        for text in translations_of(entry):
            assert sorted(PLACEHOLDER.findall(text)) == sorted(
                PLACEHOLDER.findall(entry["msgid"])
            ), entry["msgid"]
            assert set(SLASH_COMMAND.findall(text)) == set(SLASH_COMMAND.findall(entry["msgid"])), (
                entry["msgid"]
            )


def test_compiled_mo_matches_the_po(messages: list[dict[str, Any]]) -> None:
    """The .mo is committed (a fresh machine may have no msgfmt): it must not be stale."""
    with MO_PATH.open("rb") as handle:
        compiled = gettext.GNUTranslations(handle)

    assert compiled.info()["language"] == "zh_Hans"
    for entry in messages:
        if "msgid_plural" in entry:
            for n in (1, 2, 5):
                assert (
                    compiled.ngettext(entry["msgid"], entry["msgid_plural"], n)
                    == entry["msgstr[0]"]
                ), entry["msgid"]
        else:
            assert compiled.gettext(entry["msgid"]) == entry["msgstr"], entry["msgid"]


# --- pages: Accept-Language and the user's own setting -------------------------------------


@pytest.mark.parametrize("header", ["zh-hans", "zh-CN,zh;q=0.9,en;q=0.8", "zh-Hans-CN"])
def test_login_page_in_chinese_by_accept_language(client: Client, header: str) -> None:
    response = client.get("/accounts/login/", HTTP_ACCEPT_LANGUAGE=header)

    assert response.status_code == 200
    html = response.content.decode()
    assert '<html lang="zh-hans">' in html
    assert "登录以继续你的对话。" in html
    assert "用户名" in html and "密码" in html
    assert "Sign in to continue" not in html
    assert response["Content-Language"] == "zh-hans"


@pytest.mark.parametrize("header", ["en", "en-US,en;q=0.9", "fr-FR", None])
def test_login_page_in_english_by_default(client: Client, header: str | None) -> None:
    headers = {"accept-language": header} if header else {}

    response = client.get("/accounts/login/", headers=headers)

    assert response.status_code == 200
    html = response.content.decode()
    assert '<html lang="en">' in html
    assert "Sign in to continue to your conversations." in html
    assert "Username" in html and "Password" in html
    assert not has_chinese(html.replace("简体中文", ""))


def test_chat_page_follows_accept_language(client: Client, user: Any) -> None:
    client.force_login(user)

    chinese = client.get("/", HTTP_ACCEPT_LANGUAGE="zh-hans").content.decode()
    english = client.get("/", HTTP_ACCEPT_LANGUAGE="en").content.decode()

    assert "新建对话" in chinese and "New dialog" not in chinese
    assert "New dialog" in english and "新建对话" not in english


def test_set_language_makes_the_chat_page_chinese(user: Any) -> None:
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    first = client.get("/", HTTP_ACCEPT_LANGUAGE="en")
    assert "New dialog" in first.content.decode()
    token = client.cookies["csrftoken"].value

    response = client.post(
        "/i18n/setlang/",
        {"language": "zh-hans", "next": "/", "csrfmiddlewaretoken": token},
        HTTP_ACCEPT_LANGUAGE="en",
    )

    assert response.status_code == 302
    assert response["Location"] == "/"
    assert client.cookies["django_language"].value == "zh-hans"
    # The user's choice wins over the browser's Accept-Language.
    page = client.get("/", HTTP_ACCEPT_LANGUAGE="en")
    html = page.content.decode()
    assert page.status_code == 200
    assert '<html lang="zh-hans">' in html
    assert "新建对话" in html and "退出登录" in html
    assert "New dialog" not in html
    # The strings handed to app.js are Chinese too (json_script escapes them as \uXXXX).
    assert "\\u6b63\\u5728\\u8fde\\u63a5" in html  # 正在连接

    # And back to English.
    token = client.cookies["csrftoken"].value
    client.post("/i18n/setlang/", {"language": "en", "next": "/", "csrfmiddlewaretoken": token})
    assert "New dialog" in client.get("/", HTTP_ACCEPT_LANGUAGE="zh-hans").content.decode()


def test_set_language_refuses_a_post_without_csrf_token(user: Any) -> None:
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)

    response = client.post("/i18n/setlang/", {"language": "zh-hans", "next": "/"})

    assert response.status_code == 403
    assert "django_language" not in client.cookies


def test_every_js_string_is_translated() -> None:
    english = js_strings()
    with translation.override("zh-hans"):
        chinese = js_strings()

    assert chinese.keys() == english.keys()
    same = [key for key in english if chinese[key] == english[key]]
    assert same == []
    assert all(has_chinese(value) for value in chinese.values())


# --- slash commands and errors -------------------------------------------------------------


def _context() -> CommandContext:
    # /help and an unknown command touch neither the database nor the engine.
    return CommandContext(owner=User(username="zh"), channel="web", chat_id="u1", current=None)


async def test_help_command_in_chinese() -> None:
    with translation.override("zh-hans"):
        result = await run_command(_context(), "/help")

    lines = result.content.splitlines()
    assert result.ok and result.command == "help"
    assert lines[0] == "可用命令："
    # Slash commands and their usage stay as typed.
    for name, cmd in REGISTRY.items():
        assert any(line.startswith(cmd.usage + " — ") for line in lines[1:]), name


async def test_help_command_in_english() -> None:
    with translation.override("en"):
        result = await run_command(_context(), "/help")

    assert result.content.splitlines()[0] == "Commands:"
    assert "/switch <dialog_id> — Switch to another dialog" in result.content
    assert not has_chinese(result.content)


async def test_help_descriptions_in_chinese() -> None:
    with translation.override("zh-hans"):
        result = await run_command(_context(), "/help")

    lines = result.content.splitlines()[1:]
    assert len(lines) == len(REGISTRY)
    for line in lines:
        assert has_chinese(line.split(" — ", 1)[1]), line
    assert "/switch <dialog_id> — 切换到其他对话" in lines


async def test_unknown_command_error_in_chinese() -> None:
    with translation.override("zh-hans"), pytest.raises(UnknownCommand) as caught:
        await run_command(_context(), "/nope")

    assert caught.value.message == "未知命令 /nope。输入 /help 查看所有命令。"
    assert caught.value.as_dict() == {"code": "unknown_command", "message": caught.value.message}


def test_error_message_in_chinese_and_english() -> None:
    with translation.override("zh-hans"):
        chinese = QueueFull().message
    with translation.override("en"):
        english = QueueFull().message

    assert chinese == "此对话排队中的消息已达上限。"
    assert english == "This dialog already has the maximum number of queued messages."
    assert QueueFull().code == "queue_full"


def test_every_default_error_message_is_translated() -> None:
    classes = [
        cls
        for cls in vars(errors).values()
        if isinstance(cls, type) and issubclass(cls, errors.ChatError)
    ]
    assert len(classes) >= 5
    for cls in classes:
        with translation.override("zh-hans"):
            message = cls().message
        assert has_chinese(message), cls.__name__
