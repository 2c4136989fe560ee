/*
 * Attachments (SPEC H3, PROTOCOL "Files and images"): files picked with the paperclip,
 * dropped on the chat or pasted (images) upload at once to POST /api/v1/files, each with its
 * progress, and wait as chips (name, size, remove) until the message is sent with their ids.
 * A message's attachments show as thumbnails (click: the full image in a new tab) and as
 * file chips that download.
 *
 * The composer asks `readyAttachments()` / `attachmentsBusy()` when it sends, and
 * `clearAttachments()` after; the transcript asks `attachmentsView(refs)` for a message.
 */
import { $, announce, config, el, t, toast } from "./ui.js";

var FILES_URL = config.files_url || "/api/v1/files";
var MAX_BYTES = config.upload_max_bytes || 20 * 1024 * 1024;
var MAX_COUNT = config.attachments_max || 10;

// {key, name, size, preview, progress (0-1), ref (the server's answer), error, xhr}
var items = [];
var changed = function () {};
var counter = 0;

/** A size as people read it; the units are the same in every language. */
export function formatSize(bytes) {
  if (bytes < 1024) {
    return bytes + " B";
  }
  if (bytes < 1024 * 1024) {
    return (bytes / 1024).toFixed(bytes < 10240 ? 1 : 0) + " KB";
  }
  return (bytes / (1024 * 1024)).toFixed(1) + " MB";
}

export function fileUrl(fileId, thumbnail) {
  return FILES_URL + "/" + encodeURIComponent(fileId) + (thumbnail ? "?thumbnail=1" : "");
}

/** The uploaded files waiting to be sent (their refs, as a message will carry them). */
export function readyAttachments() {
  return items
    .filter(function (item) {
      return item.ref;
    })
    .map(function (item) {
      return item.ref;
    });
}

/** Whether an upload is still under way (the message waits for it). */
export function attachmentsBusy() {
  return items.some(function (item) {
    return !item.ref && !item.error;
  });
}

export function clearAttachments() {
  items.forEach(release);
  items = [];
  renderChips();
}

function release(item) {
  if (item.xhr && !item.ref && !item.error) {
    item.xhr.abort();
  }
}

function remove(item) {
  release(item);
  items = items.filter(function (other) {
    return other !== item;
  });
  renderChips();
  changed();
  $("composer-input").focus();
}

/** Put already uploaded files back on the message being written (editing one that was
 * not sent). */
export function restoreAttachments(refs) {
  (refs || []).forEach(function (ref) {
    counter += 1;
    items.push({
      key: counter,
      name: ref.name,
      size: ref.size,
      preview: ref.kind === "image" ? fileUrl(ref.file_id, true) : "",
      progress: 1,
      ref: ref,
      error: "",
      xhr: null,
    });
  });
  renderChips();
  changed();
}

/** Add files (a FileList or an array of File) to the message being written. */
export function addFiles(files) {
  Array.prototype.forEach.call(files, function (file) {
    if (items.length >= MAX_COUNT) {
      toast(t("attach_too_many", { n: MAX_COUNT }), "error");
      return;
    }
    if (file.size > MAX_BYTES) {
      toast(t("attach_too_large", { name: file.name, limit: formatSize(MAX_BYTES) }), "error");
      return;
    }
    counter += 1;
    var item = {
      key: counter,
      name: file.name || t("attach_pasted"),
      size: file.size,
      preview: "",
      progress: 0,
      ref: null,
      error: "",
      xhr: null,
    };
    items.push(item);
    upload(item, file);
  });
  renderChips();
  changed();
}

function upload(item, file) {
  var form = new FormData();
  form.append("file", file, item.name);
  var xhr = new XMLHttpRequest();
  item.xhr = xhr;
  xhr.open("POST", FILES_URL);
  xhr.setRequestHeader("X-CSRFToken", config.csrf_token || "");
  xhr.responseType = "json";
  xhr.upload.addEventListener("progress", function (event) {
    if (event.lengthComputable) {
      item.progress = event.loaded / event.total;
      updateChip(item);
    }
  });
  xhr.addEventListener("load", function () {
    var body = xhr.response || {};
    if (xhr.status === 201 && body.file_id) {
      item.ref = body;
      if (body.kind === "image") {
        // The server's thumbnail of it (same origin, as the page's policy wants).
        item.preview = fileUrl(body.file_id, true);
      }
      announce(t("attach_ready", { name: item.name }));
    } else {
      item.error = body.message || t("attach_failed");
      toast(t("attach_refused", { name: item.name, message: item.error }), "error");
    }
    renderChips();
    changed();
  });
  xhr.addEventListener("error", function () {
    item.error = t("attach_failed");
    renderChips();
    changed();
  });
  xhr.send(form);
}

function updateChip(item) {
  var bar = document.querySelector('.attach-chip[data-key="' + item.key + '"] progress');
  if (bar) {
    bar.value = item.progress;
  }
}

/** The chips above the composer: each file's name, size or progress, and remove. */
export function renderChips() {
  var box = $("attach-chips");
  box.replaceChildren();
  box.hidden = items.length === 0;
  items.forEach(function (item) {
    var chip = el("li", "attach-chip");
    chip.dataset.key = String(item.key);
    if (item.error) {
      chip.classList.add("is-error");
    }
    if (item.preview) {
      var img = el("img", "attach-preview");
      img.src = item.preview;
      img.alt = "";
      chip.appendChild(img);
    } else {
      chip.appendChild(fileIcon());
    }
    var text = el("span", "attach-text");
    text.appendChild(el("span", "attach-name", item.name));
    var meta = el("span", "attach-meta");
    if (item.error) {
      meta.textContent = item.error;
    } else if (!item.ref) {
      var bar = el("progress", "attach-progress");
      bar.max = 1;
      bar.value = item.progress;
      bar.setAttribute("aria-label", t("attach_uploading", { name: item.name }));
      meta.appendChild(bar);
    } else {
      meta.textContent = formatSize(item.size);
    }
    text.appendChild(meta);
    chip.appendChild(text);
    var close = el("button", "icon-btn attach-remove", "×");
    close.type = "button";
    close.setAttribute("aria-label", t("attach_remove", { name: item.name }));
    close.addEventListener("click", function () {
      remove(item);
    });
    chip.appendChild(close);
    box.appendChild(chip);
  });
}

/** A message's attachments: image thumbnails that open the full image, file chips that
 * download. */
export function attachmentsView(refs) {
  var box = el("div", "attachments");
  refs.forEach(function (ref) {
    if (ref.kind === "image") {
      var link = el("a", "attach-thumb");
      link.href = fileUrl(ref.file_id, false);
      link.target = "_blank";
      link.rel = "noopener";
      link.title = ref.name;
      var img = el("img");
      img.src = fileUrl(ref.file_id, true);
      img.alt = t("image", { label: ref.name });
      img.loading = "lazy";
      link.appendChild(img);
      box.appendChild(link);
    } else {
      var file = el("a", "attach-file");
      file.href = fileUrl(ref.file_id, false);
      file.setAttribute("download", ref.name);
      file.appendChild(fileIcon());
      var label = el("span", "attach-text");
      label.appendChild(el("span", "attach-name", ref.name));
      label.appendChild(el("span", "attach-meta", formatSize(ref.size)));
      file.appendChild(label);
      box.appendChild(file);
    }
  });
  return box;
}

function fileIcon() {
  var svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("viewBox", "0 0 24 24");
  svg.setAttribute("aria-hidden", "true");
  svg.setAttribute("class", "attach-icon");
  var path = document.createElementNS("http://www.w3.org/2000/svg", "path");
  path.setAttribute("d", "M14 3H7a2 2 0 0 0-2 2v14a2 2 0 0 0 2 2h10a2 2 0 0 0 2-2V8zM14 3v5h5M9 13h6M9 17h6");
  svg.appendChild(path);
  return svg;
}

function hasFiles(event) {
  var types = event.dataTransfer && event.dataTransfer.types;
  return Boolean(types) && Array.prototype.indexOf.call(types, "Files") >= 0;
}

/** Wire the paperclip, drag and drop onto the chat, and pasting images; `onChange` runs
 * whenever what is attached changes (the send button follows it). */
export function bindAttachments(onChange) {
  changed = onChange || changed;
  var input = $("attach-input");
  $("attach-button").addEventListener("click", function () {
    input.click();
  });
  input.addEventListener("change", function () {
    addFiles(input.files);
    input.value = "";
  });
  var main = $("main");
  var depth = 0;
  main.addEventListener("dragenter", function (event) {
    if (hasFiles(event)) {
      depth += 1;
      $("app").classList.add("is-dropping");
    }
  });
  main.addEventListener("dragleave", function () {
    depth = Math.max(0, depth - 1);
    if (!depth) {
      $("app").classList.remove("is-dropping");
    }
  });
  main.addEventListener("dragover", function (event) {
    if (hasFiles(event)) {
      event.preventDefault();
      event.dataTransfer.dropEffect = "copy";
    }
  });
  main.addEventListener("drop", function (event) {
    depth = 0;
    $("app").classList.remove("is-dropping");
    if (hasFiles(event)) {
      event.preventDefault();
      addFiles(event.dataTransfer.files);
    }
  });
  $("composer-input").addEventListener("paste", function (event) {
    var data = event.clipboardData;
    var pasted = [];
    Array.prototype.forEach.call((data && data.items) || [], function (entry) {
      if (entry.kind === "file" && /^image\//.test(entry.type)) {
        var file = entry.getAsFile();
        if (file) {
          pasted.push(file);
        }
      }
    });
    if (pasted.length) {
      event.preventDefault();
      addFiles(pasted);
    }
  });
  renderChips();
}
