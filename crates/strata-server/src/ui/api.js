// The server's API from the pages: the API key (when the server has one) asked for on a
// 401 and kept for the tab (sessionStorage), errors as the API words them.

const KEY = "strata.apiKey";

function keyDialog() {
  return new Promise((resolve) => {
    const d = document.getElementById("key-dialog");
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
