// strata's chat page: the server's own OpenAI API (`/v1/chat/completions`, streamed),
// conversations kept in this browser (localStorage), the API key (when the server has one)
// kept for the tab only (sessionStorage).

import { renderMarkdown, escapeHtml } from "./markdown.js";
import { sseData } from "./sse.js";
import { api, errorText } from "./api.js";

const $ = (id) => document.getElementById(id);
const CONVERSATIONS = "strata.conversations";
const SETTINGS = "strata.settings";

const state = {
  conversations: [],
  current: null,
  model: null,
  controller: null,
  attachments: [],
};

function newId() {
  return Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
}

function load(key, fallback) {
  try {
    const v = JSON.parse(localStorage.getItem(key));
    return v === null ? fallback : v;
  } catch {
    return fallback;
  }
}

function saveConversations() {
  try {
    localStorage.setItem(CONVERSATIONS, JSON.stringify(state.conversations));
  } catch (e) {
    setStatus(`Could not keep the conversations in this browser: ${e.message}`);
  }
}

function conversation() {
  return state.conversations.find((c) => c.id === state.current);
}

function setStatus(text) {
  $("status").textContent = text || "";
}

// ---- settings

const FIELDS = ["system", "temperature", "top_p", "max_tokens", "seed", "tools", "show_reasoning"];

function loadSettings() {
  const s = load(SETTINGS, {});
  for (const f of FIELDS) {
    const el = $(f);
    if (!el || !(f in s)) continue;
    if (el.type === "checkbox") el.checked = !!s[f];
    else el.value = s[f];
  }
  for (const f of FIELDS) {
    const el = $(f);
    if (el) el.addEventListener("change", () => { saveSettings(); if (f === "show_reasoning") renderMessages(); });
  }
}

function saveSettings() {
  const s = {};
  for (const f of FIELDS) {
    const el = $(f);
    if (el) s[f] = el.type === "checkbox" ? el.checked : el.value;
  }
  localStorage.setItem(SETTINGS, JSON.stringify(s));
}

function number(id) {
  const v = $(id).value.trim();
  if (v === "") return undefined;
  const n = Number(v);
  return Number.isFinite(n) ? n : undefined;
}

async function loadModel() {
  try {
    const r = await api("/v1/models");
    if (!r.ok) throw new Error(await errorText(r));
    const m = (await r.json()).data[0];
    state.model = m;
    $("model-name").textContent = m.id;
    $("attach-label").hidden = !m.vision;
  } catch (e) {
    setStatus(`Could not read the model: ${e.message}`);
  }
}

// ---- conversations

function renderList() {
  const ul = $("conversations");
  ul.replaceChildren();
  for (const c of [...state.conversations].sort((a, b) => b.updated - a.updated)) {
    const li = document.createElement("li");
    const open = document.createElement("button");
    open.type = "button";
    open.className = "conv" + (c.id === state.current ? " current" : "");
    open.textContent = c.title || "New chat";
    open.addEventListener("click", () => select(c.id));
    const del = document.createElement("button");
    del.type = "button";
    del.className = "delete";
    del.textContent = "×";
    del.setAttribute("aria-label", `Delete ${c.title || "conversation"}`);
    del.addEventListener("click", () => remove(c.id));
    li.append(open, del);
    ul.append(li);
  }
}

function newConversation() {
  if (state.controller) return;
  const c = { id: newId(), title: "", messages: [], updated: Date.now() };
  state.conversations.push(c);
  state.current = c.id;
  saveConversations();
  renderList();
  renderMessages();
  $("message").focus();
}

function select(id) {
  if (state.controller) return;
  state.current = id;
  renderList();
  renderMessages();
}

function remove(id) {
  if (state.controller && id === state.current) return;
  state.conversations = state.conversations.filter((c) => c.id !== id);
  if (state.current === id) state.current = state.conversations.length ? state.conversations.at(-1).id : null;
  if (!state.current) return newConversation();
  saveConversations();
  renderList();
  renderMessages();
}

// ---- messages

function textOf(content) {
  if (typeof content === "string") return content;
  return (content || []).filter((p) => p.type === "text").map((p) => p.text).join("\n");
}

function messageElement(m, i) {
  const div = document.createElement("div");
  div.className = `msg ${m.role}`;
  div.dataset.index = i;
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = { user: "You", assistant: "Assistant", tool: "Tool result", error: "Error" }[m.role] || m.role;
  div.append(who);
  if (m.role === "assistant") {
    fillAssistant(div, m);
  } else {
    const body = document.createElement("div");
    body.className = "body plain";
    body.textContent = textOf(m.content);
    div.append(body);
    if (Array.isArray(m.content)) {
      for (const p of m.content.filter((p) => p.type === "image_url")) {
        const img = document.createElement("img");
        img.src = p.image_url.url;
        img.alt = "attached image";
        img.className = "thumb";
        div.append(img);
      }
    }
  }
  return div;
}

function fillAssistant(div, m) {
  for (const el of [...div.children].slice(1)) el.remove();
  if (m.reasoning_content && $("show_reasoning").checked) {
    const d = document.createElement("details");
    d.className = "reasoning";
    d.open = !m.content && !(m.tool_calls || []).length;
    const s = document.createElement("summary");
    s.textContent = "Reasoning";
    const b = document.createElement("div");
    b.className = "body plain";
    b.textContent = m.reasoning_content;
    d.append(s, b);
    div.append(d);
  }
  const body = document.createElement("div");
  body.className = "body";
  body.innerHTML = renderMarkdown(m.content || "");
  div.append(body);
  for (const call of m.tool_calls || []) div.append(toolCallElement(call, m));
  if (m.finish && m.finish !== "stop" && m.finish !== "tool_calls") {
    const note = document.createElement("div");
    note.className = "muted";
    note.textContent = m.finish === "length" ? "(stopped at the token limit)" : `(${m.finish})`;
    div.append(note);
  }
}

function toolCallElement(call, m) {
  const box = document.createElement("div");
  box.className = "tool-call";
  const head = document.createElement("div");
  head.innerHTML = `Tool call <code>${escapeHtml(call.function.name || "")}</code>`;
  const args = document.createElement("pre");
  let pretty = call.function.arguments || "";
  try { pretty = JSON.stringify(JSON.parse(pretty), null, 2); } catch { /* still streaming */ }
  args.textContent = pretty;
  box.append(head, args);
  const c = conversation();
  const answered = c && c.messages.some((x) => x.role === "tool" && x.tool_call_id === call.id);
  if (m.finish === "tool_calls" && !answered) {
    const form = document.createElement("form");
    form.className = "tool-result";
    const id = `result-${call.id}`;
    const label = document.createElement("label");
    label.htmlFor = id;
    label.textContent = `Result of ${call.function.name}`;
    const input = document.createElement("textarea");
    input.id = id;
    input.rows = 2;
    const send = document.createElement("button");
    send.type = "submit";
    send.textContent = "Send result";
    form.append(label, input, send);
    form.addEventListener("submit", (e) => {
      e.preventDefault();
      sendToolResult(call, input.value);
    });
    box.append(form);
  }
  return box;
}

function renderMessages() {
  const box = $("messages");
  box.replaceChildren();
  const c = conversation();
  if (!c) return;
  c.messages.forEach((m, i) => box.append(messageElement(m, i)));
  box.scrollTop = box.scrollHeight;
  updateButtons();
}

function updateButtons() {
  const busy = !!state.controller;
  const c = conversation();
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("regenerate").disabled = busy || !c || !c.messages.some((m) => m.role === "user");
}

// ---- sending

function apiMessages(c) {
  const out = [];
  const system = $("system").value.trim();
  if (system) out.push({ role: "system", content: system });
  for (const m of c.messages) {
    if (m.role === "error") continue;
    if (m.role === "assistant") {
      const a = { role: "assistant", content: m.content || "" };
      if (m.reasoning_content) a.reasoning_content = m.reasoning_content;
      if ((m.tool_calls || []).length) a.tool_calls = m.tool_calls;
      out.push(a);
    } else if (m.role === "tool") {
      out.push({ role: "tool", tool_call_id: m.tool_call_id, content: m.content });
    } else {
      out.push({ role: m.role, content: m.content });
    }
  }
  return out;
}

function requestBody(c) {
  const body = { model: state.model ? state.model.id : undefined, messages: apiMessages(c), stream: true };
  for (const [k, id] of [["temperature", "temperature"], ["top_p", "top_p"], ["max_tokens", "max_tokens"], ["seed", "seed"]]) {
    const v = number(id);
    if (v !== undefined) body[k] = v;
  }
  const tools = $("tools").value.trim();
  if (tools) body.tools = JSON.parse(tools);
  return body;
}

async function complete() {
  const c = conversation();
  let body;
  try {
    body = requestBody(c);
  } catch (e) {
    setStatus(`The tools setting is not JSON: ${e.message}`);
    return;
  }
  const m = { role: "assistant", content: "", reasoning_content: "", tool_calls: [], finish: null };
  c.messages.push(m);
  const index = c.messages.length - 1;
  renderMessages();
  const div = $("messages").querySelector(`[data-index="${index}"]`);
  state.controller = new AbortController();
  updateButtons();
  setStatus("Generating…");
  let frame = 0;
  const paint = () => {
    if (frame) return;
    frame = requestAnimationFrame(() => {
      frame = 0;
      fillAssistant(div, m);
      const box = $("messages");
      box.scrollTop = box.scrollHeight;
    });
  };
  const started = performance.now();
  let usage = null;
  try {
    const r = await api("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(Object.assign(body, { stream_options: { include_usage: true } })),
      signal: state.controller.signal,
    });
    if (!r.ok) throw new Error(await errorText(r));
    for await (const data of sseData(r, state.controller.signal)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
      if (chunk.usage) usage = chunk.usage;
      const choice = (chunk.choices || [])[0];
      if (!choice) continue;
      const d = choice.delta || {};
      if (d.content) m.content += d.content;
      if (d.reasoning_content) m.reasoning_content += d.reasoning_content;
      for (const t of d.tool_calls || []) {
        const slot = m.tool_calls[t.index] || (m.tool_calls[t.index] = { id: "", type: "function", function: { name: "", arguments: "" } });
        if (t.id) slot.id = t.id;
        if (t.function && t.function.name) slot.function.name += t.function.name;
        if (t.function && t.function.arguments) slot.function.arguments += t.function.arguments;
      }
      if (choice.finish_reason) m.finish = choice.finish_reason;
      paint();
    }
    const secs = (performance.now() - started) / 1000;
    setStatus(usage ? `${usage.completion_tokens} tokens in ${secs.toFixed(1)} s (${(usage.completion_tokens / secs).toFixed(1)} tokens/s)` : "");
  } catch (e) {
    if (e.name === "AbortError") {
      m.finish = "stopped";
      setStatus("Stopped.");
    } else {
      c.messages.push({ role: "error", content: e.message });
      setStatus("");
    }
  } finally {
    state.controller = null;
    if (!m.content && !m.reasoning_content && !m.tool_calls.length && m.finish !== "stopped") {
      c.messages.splice(index, 1);
    }
    c.updated = Date.now();
    saveConversations();
    renderList();
    renderMessages();
  }
}

function send() {
  if (state.controller) return;
  const text = $("message").value.trim();
  if (!text && !state.attachments.length) return;
  const c = conversation();
  const content = state.attachments.length
    ? [{ type: "text", text }, ...state.attachments.map((url) => ({ type: "image_url", image_url: { url } }))]
    : text;
  c.messages.push({ role: "user", content });
  if (!c.title) c.title = (text || "Image").slice(0, 48);
  $("message").value = "";
  state.attachments = [];
  renderAttachments();
  complete();
}

function sendToolResult(call, text) {
  if (state.controller) return;
  const c = conversation();
  c.messages.push({ role: "tool", tool_call_id: call.id, content: text });
  complete();
}

function regenerate() {
  if (state.controller) return;
  const c = conversation();
  const last = c.messages.map((m) => m.role).lastIndexOf("user");
  if (last < 0) return;
  c.messages.splice(last + 1);
  complete();
}

// ---- images

function renderAttachments() {
  const box = $("attachments");
  box.replaceChildren();
  state.attachments.forEach((url, i) => {
    const img = document.createElement("img");
    img.src = url;
    img.alt = `attachment ${i + 1}`;
    img.className = "thumb";
    const drop = document.createElement("button");
    drop.type = "button";
    drop.textContent = "×";
    drop.setAttribute("aria-label", `Remove attachment ${i + 1}`);
    drop.addEventListener("click", () => { state.attachments.splice(i, 1); renderAttachments(); });
    const span = document.createElement("span");
    span.append(img, drop);
    box.append(span);
  });
}

function attach(files) {
  for (const f of files) {
    const reader = new FileReader();
    reader.onload = () => { state.attachments.push(reader.result); renderAttachments(); };
    reader.readAsDataURL(f);
  }
}

// ---- start

function init() {
  loadSettings();
  state.conversations = load(CONVERSATIONS, []);
  if (state.conversations.length) {
    state.current = [...state.conversations].sort((a, b) => b.updated - a.updated)[0].id;
    renderList();
    renderMessages();
  } else {
    newConversation();
  }
  $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  $("message").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
  });
  $("new-chat").addEventListener("click", newConversation);
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("regenerate").addEventListener("click", regenerate);
  $("attach").addEventListener("change", (e) => { attach(e.target.files); e.target.value = ""; });
  loadModel();
}

init();
