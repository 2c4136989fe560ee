"""What an upload is, decided by its bytes, never by its name (SPEC H3).

Images (PNG, JPEG, GIF, WebP) are verified and decoded with Pillow, measured, and given a
thumbnail; PDFs give their text through pypdf; anything else must be UTF-8 text. Everything
else, an image too large to decode safely, a truncated image and an encrypted or broken PDF
are refused with a clear error. Reads go chunk by chunk, so memory does not grow with the
upload (the text kept of a file is bounded by `TEXT_MAX_CHARS`).
"""

from __future__ import annotations

import codecs
import io
import logging
import mimetypes
import warnings
from dataclasses import dataclass
from typing import IO, Any

from django.utils.translation import gettext as _

from chatcore.common.errors import BadRequest, UnsupportedType

from .file_models import FileKind

logger = logging.getLogger(__name__)

# A decoded image this large (width x height) is refused as a decompression bomb; Pillow's own
# limit (`Image.MAX_IMAGE_PIXELS`) is higher and only warns below twice of it.
IMAGE_MAX_PIXELS = 40_000_000
THUMBNAIL_SIZE = (320, 320)
# The text kept of a text or PDF file (what the model may be given, before the builder trims
# it to the context budget).
TEXT_MAX_CHARS = 1_000_000
PDF_MAX_PAGES = 2000
SNIFF_BYTES = 16

IMAGE_TYPES = {"PNG": "image/png", "JPEG": "image/jpeg", "GIF": "image/gif", "WEBP": "image/webp"}


@dataclass
class Inspected:
    kind: str
    content_type: str
    text: str = ""
    width: int | None = None
    height: int | None = None
    # A JPEG of the image scaled to fit THUMBNAIL_SIZE.
    thumbnail: bytes | None = None


def _image_format(head: bytes) -> str | None:
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if head.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WEBP"
    return None


def inspect(stream: IO[bytes], *, name: str) -> Inspected:
    """The kind of the upload in `stream` (rewound first) and what is kept of it."""
    stream.seek(0)
    head = stream.read(SNIFF_BYTES)
    stream.seek(0)
    image_format = _image_format(head)
    if image_format is not None:
        return _image(stream, image_format)
    if head.startswith(b"%PDF-"):
        return _pdf(stream)
    return _text(stream, name)


def _image(stream: IO[bytes], expected: str) -> Inspected:
    from PIL import Image, UnidentifiedImageError

    refused = BadRequest(_("The image is damaged or incomplete and cannot be read."))
    try:
        with warnings.catch_warnings():
            # Pillow warns about a decompression bomb below twice its limit: refuse it too.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(stream) as probe:
                if probe.format != expected:
                    raise refused
                width, height = probe.size
                if width * height > IMAGE_MAX_PIXELS:
                    raise _too_many_pixels(width, height)
                probe.verify()
            stream.seek(0)
            with Image.open(stream) as image:
                image.load()
                thumbnail = _thumbnail(image)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise _too_many_pixels(0, 0) from None
    except (OSError, SyntaxError, ValueError, UnidentifiedImageError, EOFError) as exc:
        logger.info("image upload refused: %s", exc)
        raise refused from None
    return Inspected(
        kind=FileKind.IMAGE,
        content_type=IMAGE_TYPES[expected],
        width=width,
        height=height,
        thumbnail=thumbnail,
    )


def _too_many_pixels(width: int, height: int) -> BadRequest:
    return BadRequest(
        _("The image is too large to open safely (at most %(n)d million pixels).")
        % {"n": IMAGE_MAX_PIXELS // 1_000_000}
    )


def _thumbnail(image: Any) -> bytes:
    from PIL import Image

    frame = image.convert("RGBA")
    frame.thumbnail(THUMBNAIL_SIZE)
    # JPEG has no transparency: put the image on white.
    flat = Image.new("RGB", frame.size, (255, 255, 255))
    flat.paste(frame, mask=frame.getchannel("A"))
    out = io.BytesIO()
    flat.save(out, format="JPEG", quality=82)
    return out.getvalue()


def _pdf(stream: IO[bytes]) -> Inspected:
    from pypdf import PdfReader
    from pypdf.errors import PyPdfError

    broken = BadRequest(_("The PDF is damaged and cannot be read."))
    try:
        reader = PdfReader(stream, strict=False)
        if reader.is_encrypted:
            raise BadRequest(_("The PDF is encrypted; upload it without a password."))
        if len(reader.pages) > PDF_MAX_PAGES:
            raise BadRequest(
                _("The PDF has too many pages (at most %(n)d).") % {"n": PDF_MAX_PAGES}
            )
        parts: list[str] = []
        kept = 0
        for page in reader.pages:
            text = page.extract_text() or ""
            parts.append(text)
            kept += len(text)
            if kept >= TEXT_MAX_CHARS:
                break
    except BadRequest:
        raise
    except (PyPdfError, OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        # pypdf raises more than its own errors on malformed input.
        logger.info("PDF upload refused: %s", exc)
        raise broken from None
    except RecursionError:
        raise broken from None
    text = "\n\n".join(p.strip() for p in parts if p.strip())[:TEXT_MAX_CHARS]
    return Inspected(kind=FileKind.DOCUMENT, content_type="application/pdf", text=text)


def _text(stream: IO[bytes], name: str) -> Inspected:
    decoder = codecs.getincrementaldecoder("utf-8-sig")(errors="strict")
    pieces: list[str] = []
    kept = 0
    try:
        while chunk := stream.read(64 * 1024):
            if b"\x00" in chunk:
                # Text never holds NUL bytes: a program, an archive, an office file...
                raise UnsupportedType(
                    _(
                        "This type of file is not supported: images (PNG, JPEG, GIF, WebP), "
                        "PDF and UTF-8 text files are."
                    )
                )
            piece = decoder.decode(chunk)
            if kept < TEXT_MAX_CHARS:
                pieces.append(piece[: TEXT_MAX_CHARS - kept])
                kept += len(pieces[-1])
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise UnsupportedType(
            _("The file is not UTF-8 text; save it as UTF-8 and upload it again.")
        ) from None
    guessed, _encoding = mimetypes.guess_type(name)
    shown = guessed if guessed and _is_textual(guessed) else "text/plain"
    return Inspected(kind=FileKind.TEXT, content_type=shown, text="".join(pieces))


def _is_textual(content_type: str) -> bool:
    return content_type.startswith("text/") or content_type in (
        "application/json",
        "application/javascript",
        "application/xml",
        "application/x-sh",
        "application/sql",
        "application/toml",
        "application/yaml",
    )
