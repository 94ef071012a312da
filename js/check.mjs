// Calls the worker's OpenAI-compatible endpoint with the official `openai` npm package, the way a
// JavaScript user would: list the models, one chat completion, the same chat streamed, then the same
// question through the Responses API, whole and streamed. Prints one JSON object with what came back and
// exits 1 when something is off.
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

  const responseParams = {
    model,
    instructions: messages[0].content,
    input: messages[1].content,
    max_output_tokens: 24,
    temperature: 0,
  };
  const response = await client.responses.create(responseParams);
  const events = await client.responses.create({ ...responseParams, stream: true });
  const streamedResponse = { text: "", types: [], sequence: [], final: null };
  for await (const event of events) {
    streamedResponse.types.push(event.type);
    streamedResponse.sequence.push(event.sequence_number);
    if (event.type === "response.output_text.delta") streamedResponse.text += event.delta;
    if (event.type === "response.completed" || event.type === "response.incomplete") streamedResponse.final = event.response;
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
    response: {
      id: response.id,
      object: response.object,
      model: response.model,
      status: response.status,
      output_text: response.output_text,
      usage: response.usage,
    },
    response_stream: {
      text: streamedResponse.text,
      first: streamedResponse.types[0],
      last: streamedResponse.types.at(-1),
      events: streamedResponse.types.length,
      status: streamedResponse.final?.status ?? null,
      in_order: streamedResponse.sequence.every((n, i) => n === i),
    },
  };
  console.log(JSON.stringify(report));

  const problems = [];
  if (!models.length) problems.push("/models listed no model");
  if (!report.chat.content) problems.push("the chat completion has no content");
  if (report.stream.content !== report.chat.content) problems.push("streamed text differs from the completion at temperature 0");
  if (report.stream.ids.length !== 1) problems.push("stream chunks do not share one id");
  if (!report.stream.usage) problems.push("no usage chunk although include_usage was set");
  if (!report.response.output_text) problems.push("the response has no output_text");
  if (report.response.output_text !== report.chat.content) problems.push("the Responses API answer differs from the chat answer at temperature 0");
  if (report.response_stream.text !== report.response.output_text) problems.push("streamed response text differs from the whole response");
  if (!report.response_stream.in_order) problems.push("response events are not numbered 0, 1, 2, ...");
  if (problems.length) {
    console.error(problems.join("\n"));
    process.exit(1);
  }
}

main().catch((err) => {
  console.error(`error: ${err.status ?? ""} ${err.message}`);
  process.exit(1);
});
