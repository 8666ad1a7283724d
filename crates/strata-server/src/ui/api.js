// The server's API from the pages: the API key (when the server has one) asked for on a
// 401 and kept for the tab (sessionStorage), errors as the API words them.

const KEY = "strata.apiKey";

// The dialog that asks for the key, made on first use (both pages share it).
function keyDialog() {
  let d = document.getElementById("key-dialog");
  if (!d) {
    d = document.createElement("dialog");
    d.id = "key-dialog";
    const form = document.createElement("form");
    form.method = "dialog";
    const p = document.createElement("p");
    p.textContent = "This server asks for an API key.";
    const label = document.createElement("label");
    label.htmlFor = "api-key";
    label.textContent = "API key";
    const input = document.createElement("input");
    input.id = "api-key";
    input.type = "password";
    input.autocomplete = "off";
    const ok = document.createElement("button");
    ok.value = "ok";
    ok.textContent = "Use key";
    const actions = document.createElement("div");
    actions.className = "actions";
    actions.append(ok);
    form.append(p, label, input, actions);
    d.append(form);
    document.body.append(d);
  }
  return new Promise((resolve) => {
    d.addEventListener("close", () => resolve(document.getElementById("api-key").value.trim()), { once: true });
    d.showModal();
  });
}

export async function api(path, init = {}, retried = false) {
  const headers = Object.assign({}, init.headers || {});
  const key = sessionStorage.getItem(KEY);
  if (key) headers.Authorization = `Bearer ${key}`;
  const r = await fetch(path, Object.assign({}, init, { headers }));
  if (r.status === 401 && !retried) {
    const k = await keyDialog();
    if (k) {
      sessionStorage.setItem(KEY, k);
      return api(path, init, true);
    }
  }
  return r;
}

export async function errorText(r) {
  try {
    const j = await r.json();
    return (j.error && (j.error.message || j.error)) || JSON.stringify(j);
  } catch {
    return `${r.status} ${r.statusText}`;
  }
}
