#!/usr/bin/env python3
"""A small fake OpenAI-compatible endpoint for testing the fidelity harness.

usage: fake_endpoint.py MODE [--fail-after N]
  MODE correct  answers with the planted number it finds in the conversation
       wrong    answers with a different number (the harness must score 0)
       garbage  returns a 200 response that is not JSON
       slow     sleeps 30 s before answering (for timeouts)
       forgetful  like correct, but misses needles past 40% depth in prompts over 12,000
                characters (a plausible-looking heatmap for the docs picture)
  --fail-after N  after N good answers, every request gets HTTP 500

It binds 127.0.0.1 on a free port and prints "PORT <n>" on its first line.
A "correct" answer is only possible when the prompt is built right: the needle
sentence must be in the user message and its key must match the question; the
multi-turn codename must be in the first user message, tools must be declared,
and every tool call must have its tool result.  Anything else gets HTTP 400.
"""
import json
import re
import sys
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

MODE = sys.argv[1] if len(sys.argv) > 1 else "correct"
FAIL_AFTER = int(sys.argv[sys.argv.index("--fail-after") + 1]) if "--fail-after" in sys.argv else -1
served = 0


def find_answer(body):
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        return None, "no messages"
    last = msgs[-1]
    if last.get("role") != "user":
        return None, "last message is not from the user"
    q = last.get("content", "")
    m = re.search(r"secret code for ([\w-]+)\?", q)
    if m:  # needle
        key = m.group(1)
        hit = re.findall(r"The secret code for " + re.escape(key) + r" is (\d{6})\.", q)
        if len(hit) != 1:
            return None, "needle for %s found %d times" % (key, len(hit))
        if MODE == "forgetful" and len(q) > 12000 and q.index("The secret code for " + key) > 0.4 * len(q):
            return "000000", None
        return hit[0], None
    if "project codename" in q:  # multi-turn
        tools = body.get("tools")
        if not tools or tools[0].get("function", {}).get("name") != "search_docs":
            return None, "tools missing"
        users = [x for x in msgs if x.get("role") == "user"]
        m = re.search(r"my project codename is ([\w-]+)-(\d{6})\.", users[0].get("content", ""))
        if not m:
            return None, "codename not in the first user message"
        calls = [c["id"] for x in msgs if x.get("role") == "assistant" for c in (x.get("tool_calls") or [])]
        results = [x.get("tool_call_id") for x in msgs if x.get("role") == "tool"]
        if calls != results:
            return None, "tool calls and results do not pair up"
        return m.group(1) + "-" + m.group(2), None
    return None, "unknown question"


class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def send(self, code, data, ctype="application/json"):
        raw = data.encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_POST(self):
        global served
        n = int(self.headers.get("Content-Length", "0"))
        raw = self.rfile.read(n)
        if self.path != "/v1/chat/completions":
            return self.send(404, '{"error":{"message":"not found"}}')
        if FAIL_AFTER >= 0 and served >= FAIL_AFTER:
            return self.send(500, '{"error":{"message":"fake endpoint: internal error"}}')
        if MODE == "garbage":
            return self.send(200, "<html>this is not json</html>", "text/html")
        if MODE == "slow":
            time.sleep(30)
        try:
            body = json.loads(raw)
        except ValueError:
            return self.send(400, '{"error":{"message":"request is not JSON"}}')
        ans, why = find_answer(body)
        if ans is None:
            return self.send(400, json.dumps({"error": {"message": why}}))
        if MODE == "wrong":
            digits = re.search(r"\d{6}", ans).group(0)
            ans = "I believe it is %06d." % ((int(digits) + 1) % 1000000)
        served += 1
        words = sum(len(str(m.get("content") or "")) for m in body["messages"]) // 4
        self.send(200, json.dumps({
            "id": "fake-1", "object": "chat.completion", "model": body.get("model"),
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "The answer is " + ans + "."}}],
            "usage": {"prompt_tokens": words, "completion_tokens": 5, "total_tokens": words + 5}}))


srv = HTTPServer(("127.0.0.1", 0), H)
print("PORT", srv.server_address[1], flush=True)
srv.serve_forever()
