#!/usr/bin/env bash
# bench/load.sh: a bounded load generator for `dsv4 serve` (loopback only).
#
#   bench/load.sh [--url http://127.0.0.1:PORT] [--levels "1 4 16"] [--requests N] [--max-tokens N]
#                 [--duration S] [--api-key K]
#
# Without --url it starts `$DSV4_BIN serve` (default build/dsv4, default model) on a free port and
# stops it afterwards.  For each concurrency level it sends at most --requests streaming chat
# requests (greedy, distinct prompts so the prefix cache does not short-cut them) and stops early
# after --duration seconds, then prints throughput and TTFT / inter-token / end-to-end latency
# percentiles (p50/p90/p99).  Uses node 20's built-in fetch to time the SSE stream.
set -euo pipefail
BIN=${DSV4_BIN:-build/dsv4}
URL="" LEVELS="1 4 16" REQS=16 MAXTOK=16 DUR=120 KEY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --url) URL=$2; shift 2;;
    --levels) LEVELS=$2; shift 2;;
    --requests) REQS=$2; shift 2;;
    --max-tokens) MAXTOK=$2; shift 2;;
    --duration) DUR=$2; shift 2;;
    --api-key) KEY=$2; shift 2;;
    -h|--help) sed -n 2,12p "$0"; exit 0;;
    *) echo "load.sh: unknown option $1" >&2; exit 2;;
  esac
done
case "$URL" in ""|http://127.*|http://localhost*|http://\[::1\]*) ;; *) echo "load.sh: loopback URLs only" >&2; exit 2;; esac
SRV=""
TMP=$(mktemp -d)
trap '[ -n "$SRV" ] && kill "$SRV" 2>/dev/null; rm -rf "$TMP"' EXIT
if [ -z "$URL" ]; then
  "$BIN" serve --port 0 --max-seqs 16 --queue 64 -q >"$TMP/server.log" 2>&1 & SRV=$!
  for i in $(seq 1 300); do grep -q 'listening on' "$TMP/server.log" && break; sleep 0.1; done
  URL="http://127.0.0.1:$(grep -o 'listening on http://127.0.0.1:[0-9]*' "$TMP/server.log" | sed 's/.*://')"
fi
echo "# dsv4 serve load: $URL  levels [$LEVELS]  <= $REQS requests/level, max_tokens $MAXTOK, <= ${DUR}s/level"
for c in $LEVELS; do
  node --input-type=module - "$URL" "$c" "$REQS" "$MAXTOK" "$DUR" "$KEY" <<'JS'
const [url, conc, nreq, maxTok, dur, key] = process.argv.slice(2);
const C = +conc, N = +nreq, deadline = Date.now() + 1000 * +dur;
const ttft = [], itl = [], e2e = []; let tokens = 0, done = 0, failed = 0, next = 0;
async function one(i) {
  const t0 = performance.now(); let last = null, first = null;
  const res = await fetch(url + "/v1/chat/completions", { method: "POST",
    headers: { "Content-Type": "application/json", ...(key ? { Authorization: "Bearer " + key } : {}) },
    body: JSON.stringify({ messages: [{ role: "user", content: `Request ${i}: tell me about the number ${i * 7919}.` }],
      max_tokens: +maxTok, temperature: 0, stream: true, stream_options: { include_usage: true } }) });
  if (res.status !== 200) { failed++; await res.text(); return; }
  const dec = new TextDecoder(); let buf = "";
  for await (const part of res.body) {
    buf += dec.decode(part, { stream: true }); let k;
    while ((k = buf.indexOf("\n\n")) >= 0) {
      const ev = buf.slice(0, k); buf = buf.slice(k + 2);
      if (!ev.startsWith("data: ") || ev === "data: [DONE]") continue;
      const j = JSON.parse(ev.slice(6));
      if (j.usage) tokens += j.usage.completion_tokens;
      const d = j.choices?.[0]?.delta; if (!d || !(d.content || d.reasoning_content)) continue;
      const now = performance.now();
      if (first === null) { first = now; ttft.push(now - t0); } else itl.push(now - last);
      last = now;
    }
  }
  e2e.push(performance.now() - t0); done++;
}
async function worker() { while (next < N && Date.now() < deadline) await one(next++).catch(() => failed++); }
const t0 = performance.now();
await Promise.all(Array.from({ length: C }, worker));
const wall = (performance.now() - t0) / 1000;
const pct = (a, p) => { if (!a.length) return NaN; const s = [...a].sort((x, y) => x - y); return s[Math.min(s.length - 1, Math.floor(p / 100 * s.length))]; };
const f = (a) => [50, 90, 99].map((p) => (pct(a, p) / 1000).toFixed(3)).join("/");
console.log(`concurrency ${String(C).padStart(2)}: ${done} ok ${failed} failed in ${wall.toFixed(1)}s  ` +
  `${(tokens / wall).toFixed(1)} tok/s  ${(done / wall).toFixed(2)} req/s  ` +
  `TTFT p50/p90/p99 ${f(ttft)}s  ITL ${f(itl)}s  E2E ${f(e2e)}s`);
JS
done
if [ -n "$SRV" ]; then
  m=$(curl -s "$URL/metrics")
  echo "# after the run: running $(echo "$m" | awk '$1=="dsv4_running_sequences"{print $2}'), queued $(echo "$m" | awk '$1=="dsv4_queue_depth"{print $2}'), state bytes $(echo "$m" | awk '$1=="dsv4_state_memory_bytes"{print $2}') (prefix cache $(echo "$m" | awk '$1=="dsv4_prefix_cache_bytes"{print $2}'))"
fi
