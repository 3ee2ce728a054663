// A merged model.onnx in onnxruntime-node, step by step with the contract's inputs only
// (docs/format.md), gives the greedy tokens Python gave.
//
// Run by tests/test_runtimes.py, which writes the expected tokens and points
// ONNXMERGE_MERGED_MODEL and ONNXMERGE_STEPS_CASES at them. Run alone, it skips.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { test } from "node:test";

const modelPath = process.env.ONNXMERGE_MERGED_MODEL;
const casesPath = process.env.ONNXMERGE_STEPS_CASES;
const skip = !modelPath || !casesPath ? "ONNXMERGE_MERGED_MODEL/STEPS_CASES not set" : false;

function int64(ort, rows) {
  const flat = rows.flat().map((v) => BigInt(v));
  return new ort.Tensor("int64", BigInt64Array.from(flat), [rows.length, rows[0].length]);
}

function lastArgmax(logits) {
  const [rows, length, vocab] = logits.dims;
  return Array.from({ length: rows }, (_, r) => {
    const start = (r * length + length - 1) * vocab;
    let best = 0;
    for (let v = 1; v < vocab; v++) if (logits.data[start + v] > logits.data[start + best]) best = v;
    return best;
  });
}

test("merged model step by step gives the expected tokens", { skip }, async () => {
  const ort = await import("onnxruntime-node");
  const session = await ort.InferenceSession.create(modelPath, { executionProviders: ["cpu"] });
  const { start, steps, past_shapes: pastShapes, cases } = JSON.parse(readFileSync(casesPath, "utf8"));
  assert.ok(cases.length > 0);
  for (const c of cases) {
    const rows = c.expected.length;
    const tokens = Array.from({ length: rows }, () => [start]);
    let feeds = { decoder_input_ids: int64(ort, tokens), use_cache_branch: new ort.Tensor("bool", [false], [1]) };
    for (const [name, value] of Object.entries(c.inputs)) feeds[name] = int64(ort, value);
    for (const [name, [heads, headDim]] of Object.entries(pastShapes)) {
      feeds[name] = new ort.Tensor("float32", new Float32Array(0), [rows, heads, 0, headDim]);
    }
    const encoderPast = {};
    for (let step = 0; step < steps; step++) {
      const out = await session.run(feeds);
      lastArgmax(out.logits).forEach((t, r) => tokens[r].push(t));
      if (step === 0) {
        for (const name of Object.keys(pastShapes).filter((n) => n.includes(".encoder."))) {
          encoderPast[name] = out[name.replace("past_key_values", "present")];
        }
      }
      feeds = {
        decoder_input_ids: int64(ort, tokens.map((row) => [row[row.length - 1]])),
        use_cache_branch: new ort.Tensor("bool", [true], [1]),
        attention_mask: int64(ort, c.inputs.attention_mask),
        input_ids: new ort.Tensor("int64", new BigInt64Array(0), [rows, 0]),
        ...encoderPast,
      };
      for (const name of Object.keys(pastShapes).filter((n) => n.includes(".decoder."))) {
        feeds[name] = out[name.replace("past_key_values", "present")];
      }
    }
    assert.deepEqual(tokens, c.expected);
  }
});
