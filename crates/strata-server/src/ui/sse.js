// Server-sent events from a fetch() body: `data:` payloads, one per event, as they arrive.

export async function* sseData(response, signal) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  try {
    for (;;) {
      if (signal && signal.aborted) return;
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      yield* takeEvents(buf, (rest) => { buf = rest; });
    }
    buf += decoder.decode();
    yield* takeEvents(buf + "\n\n", () => {});
  } finally {
    reader.releaseLock();
  }
}

// Complete events of `buf` (separated by a blank line), their `data:` lines joined; what
// is left after the last complete event goes to `keep`.
export function* takeEvents(buf, keep) {
  const norm = buf.replace(/\r\n?/g, "\n");
  const events = norm.split("\n\n");
  keep(events.pop());
  for (const ev of events) {
    const data = ev.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).replace(/^ /, ""));
    if (data.length) yield data.join("\n");
  }
}
