#!/usr/bin/env bash
# End-to-end checks of `strata serve` on loopback: the official openai and anthropic
# Python packages (tests/server/test_clients.py), curl for errors and auth, and a bounded
# load test (100 concurrent requests against --max-batch 16 --queue 16).
#
# Usage: bash tests/server/e2e.sh PATH/TO/strata MODEL_DIR
# Builds nothing. Makes a Python venv (default target/pyvenv, or $STRATA_PYVENV) with the
# client packages. Stops the server on exit; exits non-zero on any failure; the last line
# is `N passed, M failed`.
set -uo pipefail

if [ $# -ne 2 ]; then
  echo "usage: bash tests/server/e2e.sh PATH/TO/strata MODEL_DIR" >&2
  exit 2
fi
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BIN=$(realpath "$1")
MODEL=$(realpath "$2")
VENV=${STRATA_PYVENV:-$ROOT/target/pyvenv}
PY_PACKAGES="openai==3.57.0 anthropic==2.14.0"
KEY="e2e-key-$RANDOM$RANDOM"
WORK=$(mktemp -d)
PASSED=0
FAILED=0
SERVER=

DOCS_SERVER=

cleanup() {
  for pid in $SERVER $DOCS_SERVER; do
    kill "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
  done
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

pass() { PASSED=$((PASSED + 1)); echo "PASS $1"; }
fail() { FAILED=$((FAILED + 1)); echo "FAIL $1"; }
finish() {
  echo "$PASSED passed, $FAILED failed"
  [ "$FAILED" -eq 0 ]
  exit
}
[ -x "$BIN" ] || { fail "binary $BIN is not executable"; finish; }
[ -d "$MODEL" ] || { fail "model directory $MODEL not found"; finish; }
T0=$(date +%s)

# --- Python venv with the official clients ---------------------------------------
if ! "$VENV/bin/python" -c "import openai, anthropic" 2>/dev/null; then
  echo "making $VENV with $PY_PACKAGES"
  if ! { python3 -m venv "$VENV" &&
    "$VENV/bin/pip" install -q --disable-pip-version-check $PY_PACKAGES; }; then
    fail "python venv with $PY_PACKAGES"
    finish
  fi
fi
PY="$VENV/bin/python"

# --- start the server --------------------------------------------------------------
PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
BASE="http://127.0.0.1:$PORT"
"$BIN" serve --model "$MODEL" --host 127.0.0.1 --port "$PORT" --api-key "$KEY" --queue 16 \
  2>"$WORK/server.log" &
SERVER=$!
for _ in $(seq 1 300); do
  curl -sf "$BASE/health" >/dev/null 2>&1 && break
  kill -0 "$SERVER" 2>/dev/null || break
  sleep 0.1
done
if ! curl -sf "$BASE/health" >/dev/null 2>&1; then
  fail "server did not come up on $BASE"
  cat "$WORK/server.log"
  finish
fi
head -1 "$WORK/server.log"
MODEL_ID=$(curl -s -H "Authorization: Bearer $KEY" "$BASE/v1/models" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
CTX=$(curl -s -H "Authorization: Bearer $KEY" "$BASE/v1/models" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["max_model_len"])')
echo "serving $MODEL_ID (context $CTX) on $BASE"

# --- the official clients ----------------------------------------------------------
"$PY" "$ROOT/tests/server/test_clients.py" "$BASE" "$KEY" "$MODEL_ID" >"$WORK/clients.out" 2>&1
cat "$WORK/clients.out"
PASSED=$((PASSED + $(grep -c '^PASS ' "$WORK/clients.out")))
FAILED=$((FAILED + $(grep -c '^FAIL ' "$WORK/clients.out")))
grep -q '^clients: ' "$WORK/clients.out" || fail "test_clients.py did not finish"

# --- curl: errors and auth ----------------------------------------------------------
# expect NAME STATUS JQ_CHECK -- CURL_ARGS...: the status must match and the Python
# expression JQ_CHECK (over the parsed JSON body `b`) must be true.
expect() {
  local name=$1 want=$2 check=$3
  shift 4
  local got
  got=$(curl -s -o "$WORK/body" -w '%{http_code}' "$@")
  if [ "$got" != "$want" ]; then
    fail "$name: HTTP $got, want $want: $(head -c 300 "$WORK/body")"
    return
  fi
  if [ -n "$check" ] && ! "$PY" -c "import json,sys; b = json.load(open(sys.argv[1])); sys.exit(0 if ($check) else 1)" "$WORK/body" 2>/dev/null; then
    fail "$name: body fails ($check): $(head -c 300 "$WORK/body")"
    return
  fi
  pass "$name"
}
AUTH=(-H "Authorization: Bearer $KEY")
JSON=(-H "Content-Type: application/json")
OA_ERR='set(b["error"]) == {"message", "type", "param", "code"} and b["error"]["type"] == "invalid_request_error"'
AN_ERR='b["type"] == "error" and b["error"]["type"] == "invalid_request_error" and b["error"]["message"]'
CHAT="$BASE/v1/chat/completions"
MSG="$BASE/v1/messages"

expect "health is open" 200 'b["status"] == "ok"' -- "$BASE/health"
expect "no key: 401" 401 'b["error"]["code"] == "invalid_api_key"' -- "$BASE/v1/models"
expect "wrong bearer key: 401" 401 '"error" in b' -- -H "Authorization: Bearer nope" "$BASE/v1/models"
expect "wrong x-api-key: 401 (anthropic shape)" 401 'b["type"] == "error" and b["error"]["type"] == "authentication_error"' -- -H "x-api-key: nope" "${JSON[@]}" -d '{}' "$MSG"
expect "bearer key: 200" 200 'b["data"][0]["id"]' -- "${AUTH[@]}" "$BASE/v1/models"
expect "x-api-key: 200" 200 'b["data"][0]["id"]' -- -H "x-api-key: $KEY" "$BASE/v1/models"
expect "malformed JSON: 400" 400 "$OA_ERR and 'JSON' in b['error']['message']" -- "${AUTH[@]}" "${JSON[@]}" -d '{"messages": [' "$CHAT"
expect "empty body: 400" 400 "$OA_ERR" -- "${AUTH[@]}" "${JSON[@]}" -d '' "$CHAT"
expect "JSON that is not an object: 400" 400 "$OA_ERR" -- "${AUTH[@]}" "${JSON[@]}" -d '[1, 2]' "$CHAT"
expect "messages of the wrong type: 400" 400 "$OA_ERR" -- "${AUTH[@]}" "${JSON[@]}" -d '{"messages": "hi"}' "$CHAT"
expect "max_tokens of the wrong type: 400" 400 "$OA_ERR" -- "${AUTH[@]}" "${JSON[@]}" -d '{"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}' "$CHAT"
expect "negative temperature: 400" 400 "$OA_ERR" -- "${AUTH[@]}" "${JSON[@]}" -d '{"messages": [{"role": "user", "content": "x"}], "temperature": -1}' "$CHAT"
expect "unknown role: 400" 400 "$OA_ERR" -- "${AUTH[@]}" "${JSON[@]}" -d '{"messages": [{"role": "wizard", "content": "x"}]}' "$CHAT"
expect "n=0: 400 naming n" 400 "$OA_ERR and b['error']['param'] == 'n'" -- "${AUTH[@]}" "${JSON[@]}" -d '{"messages": [{"role": "user", "content": "x"}], "n": 0}' "$CHAT"
expect "unknown field: 400 naming it" 400 "$OA_ERR and b['error']['param'] == 'wat'" -- "${AUTH[@]}" "${JSON[@]}" -d '{"messages": [{"role": "user", "content": "x"}], "wat": 1}' "$CHAT"
expect "temperature out of range: 400" 400 "$OA_ERR and b['error']['param'] == 'temperature'" -- "${AUTH[@]}" "${JSON[@]}" -d '{"messages": [{"role": "user", "content": "x"}], "temperature": 7}' "$CHAT"
expect "lowercase bearer: 200" 200 'b["data"][0]["id"]' -- -H "Authorization: bearer $KEY" "$BASE/v1/models"
expect "messages without max_tokens: 400" 400 "$AN_ERR and 'max_tokens' in b['error']['message']" -- -H "x-api-key: $KEY" "${JSON[@]}" -d '{"messages": [{"role": "user", "content": "x"}]}' "$MSG"
expect "empty messages (chat): 400" 400 "$OA_ERR and b['error']['param'] == 'messages'" -- "${AUTH[@]}" "${JSON[@]}" -d '{"messages": []}' "$CHAT"
expect "empty messages (messages): 400" 400 "$AN_ERR" -- -H "x-api-key: $KEY" "${JSON[@]}" -d '{"model": "'"$MODEL_ID"'", "max_tokens": 5, "messages": []}' "$MSG"
expect "malformed JSON (messages): 400" 400 "$AN_ERR" -- -H "x-api-key: $KEY" "${JSON[@]}" -d '{"messages": ' "$MSG"
expect "empty input (responses): 400" 400 "$OA_ERR" -- "${AUTH[@]}" "${JSON[@]}" -d '{"input": []}' "$BASE/v1/responses"
expect "unknown model (chat): 400" 400 "$OA_ERR and b['error']['code'] == 'model_not_found'" -- "${AUTH[@]}" "${JSON[@]}" -d '{"model": "gpt-nope", "messages": [{"role": "user", "content": "x"}]}' "$CHAT"
expect "unknown model (messages): 400" 400 "$AN_ERR" -- -H "x-api-key: $KEY" "${JSON[@]}" -d '{"model": "claude-nope", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}' "$MSG"
expect "unknown model (completions): 400" 400 "$OA_ERR" -- "${AUTH[@]}" "${JSON[@]}" -d '{"model": "nope", "prompt": "x"}' "$BASE/v1/completions"
expect "unknown route: 404" 404 '"error" in b' -- "${AUTH[@]}" "$BASE/v1/nothing"

# A prompt longer than the context: 400 with a clear message, on each API.
"$PY" - "$CTX" "$MODEL_ID" "$WORK" <<'EOF'
import json, sys
ctx, model, work = int(sys.argv[1]), sys.argv[2], sys.argv[3]
long = "hello " * (ctx + 16)
json.dump({"model": model, "messages": [{"role": "user", "content": long}]}, open(f"{work}/long_chat.json", "w"))
json.dump({"model": model, "prompt": long}, open(f"{work}/long_completion.json", "w"))
json.dump({"model": model, "max_tokens": 5, "messages": [{"role": "user", "content": long}]}, open(f"{work}/long_messages.json", "w"))
EOF
LONG_OK='b["error"]["code"] == "context_length_exceeded" and "context length" in b["error"]["message"]'
expect "oversize prompt (chat): 400" 400 "$LONG_OK" -- "${AUTH[@]}" "${JSON[@]}" --data-binary "@$WORK/long_chat.json" "$CHAT"
expect "oversize prompt (completions): 400" 400 "$LONG_OK" -- "${AUTH[@]}" "${JSON[@]}" --data-binary "@$WORK/long_completion.json" "$BASE/v1/completions"
expect "oversize prompt (messages): 400" 400 "$AN_ERR and 'context length' in b['error']['message']" -- -H "x-api-key: $KEY" "${JSON[@]}" --data-binary "@$WORK/long_messages.json" "$MSG"
expect "curl chat: 200" 200 'b["choices"][0]["message"]["role"] == "assistant" and b["usage"]["completion_tokens"] <= 4' -- "${AUTH[@]}" "${JSON[@]}" -d '{"model": "'"$MODEL_ID"'", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}' "$CHAT"
expect "stats" 200 'b["model"]["id"] and b["queue"]["capacity"] == 16 and b["totals"]["generations"] > 0' -- "${AUTH[@]}" "$BASE/stats"
# (Read whole first: `grep -q` stops early, and under pipefail curl's broken pipe would
# fail the check.)
METRICS=$(curl -s "${AUTH[@]}" "$BASE/metrics")
if grep -q '^strata_http_requests_total{route="/v1/chat/completions",status="200"} [1-9]' <<<"$METRICS" &&
  grep -q '^strata_batch_steps_total [1-9]' <<<"$METRICS"; then
  pass "metrics (Prometheus text)"
else
  fail "metrics (Prometheus text)"
fi

# A client that goes away cancels its generation.
"$PY" - "$BASE" "$KEY" "$MODEL_ID" <<'EOF' && pass "disconnect cancels the generation" || fail "disconnect cancels the generation"
import json, socket, sys, time, urllib.request, http.client
base, key, model = sys.argv[1:4]
def cancelled():
    req = urllib.request.Request(f"{base}/stats", headers={"Authorization": f"Bearer {key}"})
    return json.loads(urllib.request.urlopen(req, timeout=10).read())["totals"]["cancelled"]
before = cancelled()
host, port = base.removeprefix("http://").split(":")
c = http.client.HTTPConnection(host, int(port), timeout=30)
body = json.dumps({"model": model, "prompt": "a", "max_tokens": 100000, "stream": True, "temperature": 1.0})
c.request("POST", "/v1/completions", body, {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
r = c.getresponse()
assert r.status == 200, r.status
r.fp.readline()  # the first event has arrived: the generation is running
c.sock.shutdown(socket.SHUT_RDWR)  # close() would leave the response's file open
c.sock.close()
for _ in range(100):
    if cancelled() > before:
        sys.exit(0)
    time.sleep(0.05)
print("cancelled count did not grow", file=sys.stderr)
sys.exit(1)
EOF

# --- bounded load test: 100 concurrent requests against a queue of 16 ----------------
"$PY" - "$BASE" "$KEY" "$MODEL_ID" <<'EOF' && pass "load: 100 concurrent requests, each 200 or 429" || fail "load: 100 concurrent requests, each 200 or 429"
import json, re, sys, threading, urllib.error, urllib.request
from collections import Counter
base, key, model = sys.argv[1:4]
N = 100
auth = {"Authorization": f"Bearer {key}"}
def metric(name):
    text = urllib.request.urlopen(urllib.request.Request(f"{base}/metrics", headers=auth), timeout=30).read().decode()
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))
before = {m: metric(m) for m in ("strata_generations_total", "strata_requests_rejected_total")}
codes, retry_after, errors = [], [], []
lock = threading.Lock()
start = threading.Barrier(N)
def one(i):
    stream = i % 5 == 0  # every fifth request streams
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": f"request {i}"}],
                       "max_tokens": 24, "stream": stream}).encode()
    req = urllib.request.Request(f"{base}/v1/chat/completions", data=body,
                                 headers={**auth, "Content-Type": "application/json"})
    start.wait()
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            text = r.read().decode()
            if stream:
                ok = text.rstrip().endswith("data: [DONE]") and '"finish_reason":"' in text
            else:
                ok = json.loads(text)["choices"][0]["message"]["role"] == "assistant"
            with lock:
                codes.append(r.status if ok else -1)
    except urllib.error.HTTPError as e:
        with lock:
            codes.append(e.code)
            if e.code == 429:
                retry_after.append(e.headers.get("Retry-After"))
    except Exception as e:  # a lost request
        with lock:
            errors.append(repr(e))
threads = [threading.Thread(target=one, args=(i,)) for i in range(N)]
for t in threads: t.start()
for t in threads: t.join(150)
count = Counter(codes)
print(f"  load: {dict(count)}, lost: {len(errors)} {errors[:3]}")
assert not errors and len(codes) == N, "lost requests"
assert set(count) <= {200, 429}, count
assert count[200] >= 1, count
assert all(ra and int(ra) >= 1 for ra in retry_after), retry_after
# The server's own counts agree: one generation per 200, one rejection per 429.
assert metric("strata_generations_total") - before["strata_generations_total"] == count[200]
assert metric("strata_requests_rejected_total") - before["strata_requests_rejected_total"] == count[429]
assert metric("strata_queue_depth") == 0 and metric("strata_generation_active") == 0
EOF
expect "healthy after the load" 200 'b["status"] == "ok"' -- "$BASE/health"
expect "serves after the load" 200 'b["choices"][0]["finish_reason"] in ("stop", "length")' -- "${AUTH[@]}" "${JSON[@]}" -d '{"messages": [{"role": "user", "content": "still there?"}], "max_tokens": 4}' "$CHAT"
if kill -0 "$SERVER" 2>/dev/null; then pass "server still running"; else fail "server still running"; fi

kill "$SERVER" 2>/dev/null
wait "$SERVER" 2>/dev/null
SERVER=

# --- the examples of docs/server.md, as written (the fixture model, port 8080) ----------
if python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 8080))' 2>/dev/null; then
  "$BIN" serve --model "$ROOT/fixtures/glm5/dsa-sparse" --port 8080 2>"$WORK/docs-server.log" &
  DOCS_SERVER=$!
  for _ in $(seq 1 300); do
    curl -sf http://127.0.0.1:8080/health >/dev/null 2>&1 && break
    sleep 0.1
  done
  "$PY" - "$ROOT/docs/server.md" "$WORK" <<'EOF'
import re, sys
text = open(sys.argv[1]).read()
examples = text[text.index("## Examples"):text.index("## Routes")]
blocks = re.findall(r"```(bash|python)\n(.*?)```", examples, re.S)
for i, (lang, code) in enumerate(blocks):
    open(f"{sys.argv[2]}/doc_example_{i}.{'sh' if lang == 'bash' else 'py'}", "w").write(code)
EOF
  for f in "$WORK"/doc_example_*; do
    case "$f" in
      *.sh) out=$(bash "$f" 2>&1) && echo "$out" | "$PY" -c 'import json,sys; assert json.load(sys.stdin)["choices"][0]["message"]["role"] == "assistant"' 2>/dev/null ;;
      *.py) out=$("$PY" "$f" 2>&1) ;;
    esac && pass "docs/server.md example $(basename "$f")" || fail "docs/server.md example $(basename "$f"): $out"
  done
else
  echo "SKIP docs/server.md examples: port 8080 is taken"
fi

# --- speculative decoding: strata-tiny's MTP layer, through the official clients ----------
PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$BIN" serve --model "$ROOT/models/strata-tiny" --host 127.0.0.1 --port "$PORT" --max-batch 4 \
  --draft-policy fixed 2>"$WORK/mtp-server.log" &
SERVER=$!
for _ in $(seq 1 300); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
  kill -0 "$SERVER" 2>/dev/null || break
  sleep 0.1
done
if grep -q "MTP 3 drafts (fixed)" "$WORK/mtp-server.log"; then pass "serve drafts with strata-tiny's MTP layer by default"; else fail "MTP banner: $(cat "$WORK/mtp-server.log")"; fi
cat >"$WORK/mtp_clients.py" <<'EOF'
import sys, concurrent.futures as cf
import anthropic, openai
base = sys.argv[1]
oa = openai.OpenAI(base_url=base + "/v1", api_key="none")
prompts = ["In the beginning God created", "The quick brown fox", "Once upon a time there was"]
def complete(p):
    return oa.completions.create(model="strata-tiny", prompt=p, max_tokens=32, temperature=0)
with cf.ThreadPoolExecutor(3) as pool:
    whole = list(pool.map(complete, prompts))
for p, r in zip(prompts, whole):
    mtp = r.usage.model_extra["mtp"]
    assert mtp["drafted"] > 0 and mtp["policy"] == "fixed", mtp
    # Streamed: the same greedy text, and the usage chunk reports the drafts too.
    parts, usage = [], None
    for c in oa.completions.create(model="strata-tiny", prompt=p, max_tokens=32, temperature=0, stream=True,
                                   stream_options={"include_usage": True}):
        parts += [ch.text for ch in c.choices]
        usage = c.usage or usage
    assert "".join(parts) == r.choices[0].text, (p, parts, r.choices[0].text)
    assert usage.model_extra["mtp"]["drafted"] == mtp["drafted"], (usage, mtp)
msg = anthropic.Anthropic(base_url=base, api_key="none").messages.create(
    model="strata-tiny", max_tokens=16, messages=[{"role": "user", "content": "Tell me a story"}])
assert msg.usage.model_extra["mtp"]["rounds"] > 0, msg.usage
EOF
if out=$("$PY" "$WORK/mtp_clients.py" "http://127.0.0.1:$PORT" 2>&1); then
  pass "MTP usage through the openai and anthropic clients, streamed text equal"
else
  fail "MTP through the clients: $out"
fi
kill "$SERVER" 2>/dev/null
wait "$SERVER" 2>/dev/null
SERVER=

echo "e2e took $(($(date +%s) - T0)) s"
finish
