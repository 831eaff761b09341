// Streams Generate from a running minivllm server using nothing but protos/inference.proto.
// MINIVLLM_TARGET: host:port; MINIVLLM_EXPECTED: JSON {prompt, text, token_ids} from the Python side;
// optional MINIVLLM_TLS_CA (PEM file: use TLS) and MINIVLLM_TOKEN (bearer token).
import { test } from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import grpc from '@grpc/grpc-js';
import protoLoader from '@grpc/proto-loader';

const here = path.dirname(fileURLToPath(import.meta.url));
const definition = protoLoader.loadSync(path.join(here, '..', '..', 'protos', 'inference.proto'), {
  keepCase: true, longs: Number, enums: String, defaults: true, oneofs: true,
});
const { Inference } = grpc.loadPackageDefinition(definition).minivllm.v1;
const caFile = process.env.MINIVLLM_TLS_CA;
const token = process.env.MINIVLLM_TOKEN;
const credentials = caFile ? grpc.credentials.createSsl(fs.readFileSync(caFile)) : grpc.credentials.createInsecure();
const client = new Inference(process.env.MINIVLLM_TARGET, credentials);
const expected = JSON.parse(process.env.MINIVLLM_EXPECTED);

function metadata(withToken = true) {
  const md = new grpc.Metadata();
  if (token && withToken) md.add('authorization', `Bearer ${token}`);
  return md;
}

function collect(request, withToken = true) {
  return new Promise((resolve, reject) => {
    const chunks = [];
    const call = client.Generate(request, metadata(withToken), { deadline: Date.now() + 60000 });
    call.on('data', (chunk) => chunks.push(chunk));
    call.on('error', reject);
    call.on('end', () => resolve(chunks));
  });
}

test('Generate streams the same greedy text as the Python engine', async () => {
  const chunks = await collect({
    prompt: expected.prompt,
    sampling: { temperature: 0, max_tokens: expected.token_ids.length, ignore_eos: true },
  });
  assert.ok(chunks.length > 1, 'expected several streamed messages');
  const last = chunks[chunks.length - 1];
  assert.equal(last.finish_reason, 'length');
  assert.equal(last.usage.completion_tokens, expected.token_ids.length);
  assert.deepEqual(chunks.flatMap((c) => c.token_ids), expected.token_ids);
  assert.equal(chunks.map((c) => c.text).join(''), expected.text);
});

test('bad sampling params come back as INVALID_ARGUMENT naming the field', async () => {
  await assert.rejects(collect({ prompt: 'hi', sampling: { temperature: -1 } }), (err) => {
    assert.equal(err.code, grpc.status.INVALID_ARGUMENT);
    assert.match(err.details, /temperature/);
    return true;
  });
});

test('without the token the server says UNAUTHENTICATED', { skip: !token }, async () => {
  await assert.rejects(collect({ prompt: 'hi' }, false), (err) => {
    assert.equal(err.code, grpc.status.UNAUTHENTICATED);
    return true;
  });
});

test('n samples, structured output and logprob token texts', async () => {
  const chunks = await collect({
    prompt: 'code:',
    sampling: { n: 3, temperature: 1, seed: 5, max_tokens: 30, regex: '[0-9]{3}-[a-z]{2,4}', logprobs: 1 },
  });
  const texts = ['', '', ''];
  for (const c of chunks) texts[c.index] += c.text;
  for (const text of texts) assert.match(text, /^[0-9]{3}-[a-z]{2,4}$/);
  assert.deepEqual(chunks.filter((c) => c.finish_reason).map((c) => c.index).sort(), [0, 1, 2]);
  assert.equal(chunks.filter((c) => c.usage).length, 1, 'usage once, on the last message');
  // Each chosen token's text, joined per sample, is that sample's (ASCII) text.
  const tokenTexts = ['', '', ''];
  for (const c of chunks) tokenTexts[c.index] += c.logprobs.map((lp) => lp.chosen.token).join('');
  assert.deepEqual(tokenTexts, texts);
});

test('chat with a required tool: the call streams name first, then arguments that parse', async () => {
  const parameters = {
    type: 'object', additionalProperties: false, required: ['city', 'days'],
    properties: { city: { type: 'string', maxLength: 10 }, days: { type: 'integer', minimum: 1, maximum: 7 } },
  };
  const chunks = await collect({
    messages: {
      messages: [{ role: 'user', content: 'Weather in Paris?' }],
      tools: [{ name: 'get_weather', description: 'The weather', parameters: JSON.stringify(parameters) }],
      tool_choice: 'required',
      parallel_tool_calls: false,
    },
    sampling: { temperature: 0.8, seed: 1, max_tokens: 120 },
  });
  const deltas = chunks.flatMap((c) => c.tool_calls);
  assert.equal(deltas[0].name, 'get_weather');
  assert.match(deltas[0].id, /^call_/);
  const args = JSON.parse(deltas.map((d) => d.arguments).join(''));
  assert.deepEqual(Object.keys(args).sort(), ['city', 'days']);
  assert.ok(args.days >= 1 && args.days <= 7 && args.city.length <= 10);
  assert.equal(chunks[chunks.length - 1].finish_reason, 'tool_calls');
  assert.equal(chunks.map((c) => c.text).join(''), '', 'the call is not content');
});

test('GetModelInfo answers', async () => {
  const info = await new Promise((resolve, reject) =>
    client.GetModelInfo({}, metadata(), (err, res) => (err ? reject(err) : resolve(res))));
  assert.ok(info.vocab_size > 0 && info.max_model_len > 0);
  client.close();
});
