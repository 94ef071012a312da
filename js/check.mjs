// Calls the worker's OpenAI-compatible endpoint with the official `openai` npm package, the way a
// JavaScript user would: list the models, one chat completion, the same chat streamed. Prints one JSON
// object with what came back and exits 1 when something is off.
//
//   node check.mjs https://api.runpod.ai/v2/<ENDPOINT_ID>/openai/v1     (RUNPOD_API_KEY in the environment)
//   node check.mjs http://127.0.0.1:8000/openai/v1                       (python handler.py --serve)
//
// The base URL also comes from OPENAI_BASE_URL, the key from RUNPOD_API_KEY or OPENAI_API_KEY, and the
// model from CHECK_MODEL (default: the first one /models lists).
import OpenAI from "openai";

const baseURL = process.argv[2] || process.env.OPENAI_BASE_URL;
if (!baseURL) {
  console.error("usage: node check.mjs <base URL ending in /openai/v1>");
  process.exit(2);
}
const client = new OpenAI({
  baseURL,
  apiKey: process.env.RUNPOD_API_KEY || process.env.OPENAI_API_KEY || "not-needed-locally",
  maxRetries: 0,
  timeout: 120_000,
});

const messages = [
  { role: "system", content: "You are a helpful assistant that answers briefly." },
  { role: "user", content: "Name three colors of the rainbow." },
];
const params = { messages, max_tokens: 24, temperature: 0 };

async function main() {
  const models = [];
  for await (const model of client.models.list()) models.push(model.id);
  const model = process.env.CHECK_MODEL || models[0];

  const chat = await client.chat.completions.create({ ...params, model });

  const stream = await client.chat.completions.create({
    ...params,
    model,
    stream: true,
    stream_options: { include_usage: true },
  });
  const streamed = { content: "", chunks: 0, ids: new Set(), roles: [], finish_reason: null, usage: null };
  for await (const chunk of stream) {
    streamed.chunks += 1;
    streamed.ids.add(chunk.id);
    if (chunk.usage) streamed.usage = chunk.usage;
    for (const choice of chunk.choices) {
      if (choice.delta.role) streamed.roles.push(choice.delta.role);
      streamed.content += choice.delta.content ?? "";
      if (choice.finish_reason) streamed.finish_reason = choice.finish_reason;
    }
  }

  const report = {
    models,
    model,
    chat: {
      id: chat.id,
      object: chat.object,
      model: chat.model,
      role: chat.choices[0].message.role,
      content: chat.choices[0].message.content,
      finish_reason: chat.choices[0].finish_reason,
      usage: chat.usage,
    },
    stream: { ...streamed, ids: [...streamed.ids] },
  };
  console.log(JSON.stringify(report));

  const problems = [];
  if (!models.length) problems.push("/models listed no model");
  if (!report.chat.content) problems.push("the chat completion has no content");
  if (report.stream.content !== report.chat.content) problems.push("streamed text differs from the completion at temperature 0");
  if (report.stream.ids.length !== 1) problems.push("stream chunks do not share one id");
  if (!report.stream.usage) problems.push("no usage chunk although include_usage was set");
  if (problems.length) {
    console.error(problems.join("\n"));
    process.exit(1);
  }
}

main().catch((err) => {
  console.error(`error: ${err.status ?? ""} ${err.message}`);
  process.exit(1);
});
