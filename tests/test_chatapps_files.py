"""Files sent in the chat apps (H3): Telegram photos and documents, Feishu images and files,
fetched through the fake platforms' download methods, stored as the sender's uploads,
attached to their message and given to the model; a file the platform will not give, or
one that is not supported, is answered in the chat and nothing is stored."""

# ruff: noqa: F811 - the imported fixtures are requested by name as test arguments

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import sync_to_async

from sessions_app.models import ChannelAccount, File, Message
from tests.fakemodel import Reply
from tests.file_helpers import png_bytes, stored_files, text_pdf
from tests.telegram_helpers import Bot, bot, bot_with, fake_telegram  # noqa: F401
from tests.test_chatapps_feishu import App, app, app_with, fake_feishu  # noqa: F401

pytestmark = [pytest.mark.django_db(transaction=True)]


@pytest.fixture(autouse=True)
def storage_dir(settings: Any, tmp_path: Path) -> Path:
    settings.STORAGES = {
        **settings.STORAGES,
        "default": {
            "BACKEND": "django.core.files.storage.FileSystemStorage",
            "OPTIONS": {"location": str(tmp_path / "files")},
        },
    }
    return tmp_path / "files"


def _parts(fake_model: Any) -> list[dict[str, Any]]:
    request = fake_model.turn_requests()[-1]
    return [m for m in request.messages if m["role"] == "user"][-1]["content"]


async def _user_message() -> Message:
    return await sync_to_async(lambda: Message.objects.filter(role="user").get())()


async def test_a_telegram_photo_with_a_caption_reaches_the_model(bot: Bot, fake_model: Any) -> None:
    # covers: H3, D5
    photo = png_bytes((64, 48), "purple")
    fake_model.script(Reply(text="A purple rectangle."))
    update, outcome = await bot.say("what is this?", photo=photo)
    assert outcome == "send"
    await bot.idle()

    parts = _parts(fake_model)
    assert parts[0]["text"].startswith("what is this?")
    assert base64.b64decode(parts[1]["image_url"]["url"].split(",", 1)[1]) == photo
    message = await _user_message()
    assert message.content == "what is this?"
    assert message.media_refs[0]["kind"] == "image"
    assert message.media_refs[0]["size"] == len(photo)
    stored = await File.objects.aget(pk=message.media_refs[0]["file_id"])
    # The dialog's owner's file: whoever reads the dialog (on the web once linked) opens it.
    assert stored.owner_id == (await sync_to_async(lambda: message.session.owner_id)())
    # The largest size Telegram listed was fetched, not its thumbnail.
    assert [c.body["file_id"] for c in bot.fake.calls_of("getFile")] == [
        update["message"]["photo"][-1]["file_id"]
    ]
    assert bot.answers_to(update)[-1].text.startswith("A purple rectangle.")


async def test_a_photo_in_a_group_belongs_to_the_dialogs_owner(bot: Bot, fake_model: Any) -> None:
    # covers: H3, A1
    fake_model.script(Reply(text="first"), Reply(text="seen"))
    await bot.say("@testbot hello", group=True, chat_id=-100, user_id=7)
    await bot.idle()
    await bot.say("@testbot look", group=True, chat_id=-100, user_id=8, photo=png_bytes())
    await bot.idle()
    message = await sync_to_async(
        lambda: Message.objects.filter(role="user").exclude(media_refs=[]).get()
    )()
    stored = await File.objects.aget(pk=message.media_refs[0]["file_id"])
    owner = await sync_to_async(lambda: message.session.owner_id)()
    sender = await ChannelAccount.objects.aget(channel="telegram", external_id="8")
    assert stored.owner_id == owner != sender.identity_id


async def test_a_telegram_document_without_a_caption_is_sent_as_its_text(
    bot: Bot, fake_model: Any
) -> None:
    # covers: H3
    fake_model.script(Reply(text="Read it."))
    _update, outcome = await bot.say("", document=("report.pdf", text_pdf("Budget approved")))
    assert outcome == "send"
    await bot.idle()
    parts = _parts(fake_model)
    assert parts[0]["text"].startswith("File: report.pdf") or parts[1]["text"].startswith(
        "File: report.pdf"
    )
    assert any("Budget approved" in p.get("text", "") for p in parts)


async def test_an_unsupported_telegram_document_is_answered_and_nothing_stored(
    bot: Bot, storage_dir: Path
) -> None:
    # covers: H3, D5
    update, outcome = await bot.say("run this", document=("tool.exe", b"MZ\x90\x00" + bytes(64)))
    assert outcome == "error"
    answer = bot.answers_to(update)[-1].text
    assert "not supported" in answer
    assert await File.objects.acount() == 0 and stored_files(storage_dir) == []
    assert await Message.objects.filter(role="user").acount() == 0


async def test_a_file_telegram_will_not_give_is_answered(bot: Bot) -> None:
    # covers: H3
    update = bot.fake.update("look", photo=png_bytes())
    bot.fake.files.clear()  # the platform lost it
    response = await bot.post(update)
    assert response.json()["result"] == "error"
    assert "could not be fetched" in bot.answers_to(update)[-1].text
    assert await File.objects.acount() == 0


async def test_feishu_images_and_files_are_attachments(app: App, fake_model: Any) -> None:
    # covers: H3
    image = png_bytes((10, 10), "orange")
    event = app.event("")
    message = event["event"]["message"]
    message["message_type"] = "image"
    message["content"] = json.dumps({"image_key": app.fake.add_file(image)})
    fake_model.script(Reply(text="Orange."), Reply(text="Noted."))
    await app.post(event)
    await app.idle()
    parts = _parts(fake_model)
    image_part = next(p for p in parts if p["type"] == "image_url")
    assert base64.b64decode(image_part["image_url"]["url"].split(",", 1)[1]) == image
    resource = app.fake.calls_of("resource")[-1]
    assert resource.query["type"] == "image"
    assert resource.path.split("/")[-3] == message["message_id"]

    event = app.event("")
    message = event["event"]["message"]
    message["message_type"] = "file"
    key = app.fake.add_file(b"col_a,col_b\n1,2\n")
    message["content"] = json.dumps({"file_key": key, "file_name": "data.csv"})
    await app.post(event)
    await app.idle()
    text = next(p["text"] for p in _parts(fake_model) if p["text"].startswith("File: data.csv"))
    assert "col_a,col_b" in text
    assert await File.objects.acount() == 2
