// Drives `dsv4 serve` with the official openai npm client.  Started by
// tests/cli_server.sh with DSV4_BASE_URL and DSV4_API_KEY; prints PASS/FAIL lines.
import OpenAI from "openai";

const client = new OpenAI({ baseURL: process.env.DSV4_BASE_URL, apiKey: process.env.DSV4_API_KEY, maxRetries: 0 });
const user = (content) => ({ role: "user", content });
const tools = [{
  type: "function",
  function: { name: "get_weather", description: "Weather for a city",
              parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] } },
}];
// What the model writes to call a tool (DSML, docs/CHAT_FORMAT.md) and then EOS, forced through the
// server's test hook (the default model is random and never calls tools by itself).
const DSML_CALL = "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n" +
  "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>";

async function test(name, fn) {
  try { await fn(); console.log(`PASS node_${name}`); }
  catch (e) { console.log(`FAIL node_${name}: ${e && e.message ? e.message : e}`); }
}
function assert(cond, msg) { if (!cond) throw new Error(msg); }

await test("streaming", async () => {
  const stream = await client.chat.completions.create({
    model: "deepseek-chat", messages: [user("Say hi")], max_tokens: 4, temperature: 0, stream: true,
    stream_options: { include_usage: true } });
  let text = "", chunks = 0, finish = null, usage = null;
  for await (const c of stream) {
    chunks++;
    if (c.usage) usage = c.usage;
    const ch = c.choices[0];
    if (ch) { text += ch.delta.content ?? ""; if (ch.finish_reason) finish = ch.finish_reason; }
  }
  assert(chunks >= 3, `only ${chunks} chunks`);
  assert(finish === "length", `finish ${finish}`);
  assert(usage && usage.completion_tokens === 4, `usage ${JSON.stringify(usage)}`);
  const whole = await client.chat.completions.create({ model: "deepseek-chat", messages: [user("Say hi")], max_tokens: 4, temperature: 0 });
  assert(whole.choices[0].message.content === text, `stream '${text}' vs whole '${whole.choices[0].message.content}'`);
});

await test("tools_accepted_and_tool_result_rendered", async () => {
  const r = await client.chat.completions.create({
    model: "deepseek-chat", max_tokens: 2, temperature: 0, tools, tool_choice: "auto",
    messages: [user("Weather in Paris?"),
      { role: "assistant", content: null, tool_calls: [{ id: "call_1", type: "function", function: { name: "get_weather", arguments: "{\"city\":\"Paris\"}" } }] },
      { role: "tool", tool_call_id: "call_1", content: "sunny, 21C" }] });
  assert(r.choices[0].message.role === "assistant", "no assistant message");
  assert(r.usage.prompt_tokens > 20, `prompt only ${r.usage.prompt_tokens} tokens: tools/tool result not rendered?`);
});

await test("tool_call_parsed_nonstream", async () => {
  const r = await client.chat.completions.create({
    model: "deepseek-chat", messages: [user("Weather in Paris?")], tools, max_tokens: 80, temperature: 0,
    dsv4_forced_output: DSML_CALL });
  const m = r.choices[0].message;
  assert(r.choices[0].finish_reason === "tool_calls", `finish ${r.choices[0].finish_reason}`);
  assert(m.tool_calls && m.tool_calls.length === 1, `tool_calls ${JSON.stringify(m.tool_calls)}`);
  assert(m.tool_calls[0].function.name === "get_weather", "name");
  assert(JSON.parse(m.tool_calls[0].function.arguments).city === "Paris", `arguments ${m.tool_calls[0].function.arguments}`);
});

await test("tool_call_parsed_stream", async () => {
  const stream = await client.chat.completions.create({
    model: "deepseek-chat", messages: [user("Weather in Paris?")], tools, max_tokens: 80, temperature: 0, stream: true,
    dsv4_forced_output: DSML_CALL });
  const calls = []; let finish = null, content = "";
  for await (const c of stream) {
    const ch = c.choices[0]; if (!ch) continue;
    for (const tc of ch.delta.tool_calls ?? []) calls.push(tc);
    content += ch.delta.content ?? "";
    if (ch.finish_reason) finish = ch.finish_reason;
  }
  assert(finish === "tool_calls", `finish ${finish}`);
  assert(calls.length === 1 && calls[0].function.name === "get_weather" && calls[0].id, `calls ${JSON.stringify(calls)}`);
  assert(!content.includes("DSML"), `markup leaked into content: ${content}`);
});

await test("multiturn_reasoning_passed_back", async () => {
  const msgs = [user("What is 2+2?")];
  const r1 = await client.chat.completions.create({ model: "deepseek-reasoner", messages: msgs, max_tokens: 30, temperature: 0,
    dsv4_forced_output: "Add them.</think>4" });
  const m1 = r1.choices[0].message;
  assert(m1.reasoning_content === "Add them.", `reasoning ${JSON.stringify(m1.reasoning_content)}`);
  assert(m1.content.startsWith("4"), `content ${JSON.stringify(m1.content)}`);
  msgs.push({ role: "assistant", content: m1.content, reasoning_content: m1.reasoning_content }, user("And 3+3?"));
  const r2 = await client.chat.completions.create({ model: "deepseek-reasoner", messages: msgs, max_tokens: 3, temperature: 0 });
  assert(r2.usage.prompt_tokens > r1.usage.prompt_tokens, "second turn is not longer");
  const cached = r2.usage.prompt_tokens_details?.cached_tokens ?? 0;
  assert(cached > 0, `no prefix reuse on the next turn (cached ${cached})`);
});

await test("errors_are_api_errors", async () => {
  try {
    await client.chat.completions.create({ model: "x", messages: [] });
    throw new Error("no error");
  } catch (e) {
    assert(e instanceof OpenAI.APIError && e.status === 400 && /must not be empty/.test(e.message), `got ${e}`);
  }
  const bad = new OpenAI({ baseURL: process.env.DSV4_BASE_URL, apiKey: "wrong", maxRetries: 0 });
  try { await bad.models.list(); throw new Error("no error"); }
  catch (e) { assert(e.status === 401, `status ${e.status}`); }
});

await test("models_and_completions", async () => {
  const models = await client.models.list();
  assert(models.data.some((m) => m.id === "deepseek-chat"), "deepseek-chat not listed");
  const c = await client.completions.create({ model: "deepseek-chat", prompt: "Once upon", max_tokens: 3, temperature: 0 });
  assert(c.choices[0].finish_reason === "length" && c.usage.completion_tokens === 3, JSON.stringify(c));
});
