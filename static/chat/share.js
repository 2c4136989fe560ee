/*
 * The share page (/s/{id}, SPEC H2): the answers, served as plain text, rendered by the
 * chat's own safe Markdown module (marked + DOMPurify, no remote images).
 */
import { renderMarkdownInto } from "./markdown.js";

document.querySelectorAll(".share-md").forEach(function (node) {
  renderMarkdownInto(node, node.textContent, false);
});
