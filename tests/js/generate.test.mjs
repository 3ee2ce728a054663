// The generator model in onnxruntime-node gives the tokens Python gave.
//
// Run by tests/test_generator.py, which writes the model and the expected tokens and points
// ONNXMERGE_GENERATOR_MODEL and ONNXMERGE_GENERATOR_CASES at them. Run alone, it skips.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { test } from "node:test";

const modelPath = process.env.ONNXMERGE_GENERATOR_MODEL;
const casesPath = process.env.ONNXMERGE_GENERATOR_CASES;
const skip = !modelPath || !casesPath ? "ONNXMERGE_GENERATOR_MODEL/CASES not set" : false;

function int64Tensor(ort, rows) {
  const flat = rows.flat().map((v) => BigInt(v));
  const dims = Array.isArray(rows[0]) ? [rows.length, rows[0].length] : [rows.length];
  return new ort.Tensor("int64", BigInt64Array.from(flat), dims);
}

// Audio rows (the audio generator's PCM): float32, [batch, samples].
function float32Tensor(ort, rows) {
  return new ort.Tensor("float32", Float32Array.from(rows.flat()), [rows.length, rows[0].length]);
}

function toRows(tensor) {
  const [batch, length] = tensor.dims;
  const values = Array.from(tensor.data, (v) => Number(v));
  return Array.from({ length: batch }, (_, r) => values.slice(r * length, (r + 1) * length));
}

test("generator model generates the expected token ids", { skip }, async () => {
  const ort = await import("onnxruntime-node");
  const session = await ort.InferenceSession.create(modelPath, { executionProviders: ["cpu"] });
  assert.ok(session.inputNames.includes("max_new_tokens"));
  assert.ok(session.outputNames.includes("sequences"));
  const cases = JSON.parse(readFileSync(casesPath, "utf8"));
  assert.ok(cases.length > 0);
  for (const c of cases) {
    const feeds = {
      max_new_tokens: new ort.Tensor("int64", BigInt64Array.from([BigInt(c.max_new_tokens)]), []),
    };
    for (const [name, rows] of Object.entries(c.inputs)) feeds[name] = int64Tensor(ort, rows);
    for (const [name, rows] of Object.entries(c.float_inputs ?? {})) {
      feeds[name] = float32Tensor(ort, rows);
    }
    const result = await session.run(feeds);
    assert.deepEqual(toRows(result.sequences), c.expected, `max_new_tokens=${c.max_new_tokens}`);
  }
});
