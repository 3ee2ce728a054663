// Loads site.json, the tokenizer and the generator model, then translates what is typed.
// The generator model holds the whole decoding loop: one session.run turns token ids into
// token ids, so no generation code lives here.

import { $, createSession, fetchJson, importPackages, missingFeature, readyText, runSequences, showError, start } from "./page.js";

// tokenizers.js 0.2.0 ignores Metaspace's "split": the Rust library splits the text into words
// at each replacement character, and a word-level vocabulary only knows the split words.
function applyMetaspaceSplit(instance, config) {
  if (!instance || !config) return;
  if (config.type === "Sequence") {
    (config.pretokenizers ?? []).forEach((c, i) => applyMetaspaceSplit(instance.tokenizers?.[i], c));
  } else if (config.type === "Metaspace" && config.split !== false) {
    const replacement = config.replacement ?? "\u2581";
    const original = instance.pre_tokenize_text.bind(instance);
    instance.pre_tokenize_text = (text, options) =>
      original(text, options).flatMap((piece) => piece.split(new RegExp(`(?=${replacement})`, "u")));
  }
}

async function load() {
  const missing = missingFeature();
  if (missing) {
    showError(`This browser lacks ${missing}, which the translator needs: use a current Chrome, Edge, Firefox or Safari.`);
    return null;
  }
  const packages = await importPackages("onnxruntime-web", "@huggingface/tokenizers");
  if (!packages) return null;
  const [ort, { Tokenizer }] = packages;
  const started = performance.now();
  const site = await fetchJson("site.json");
  const [tokenizerJson, tokenizerConfig] = await Promise.all([
    fetchJson("tokenizer.json"),
    fetchJson("tokenizer_config.json"),
  ]);
  const tokenizer = new Tokenizer(tokenizerJson, tokenizerConfig);
  applyMetaspaceSplit(tokenizer.pre_tokenizer, tokenizerJson.pre_tokenizer);

  const params = new URLSearchParams(location.search);
  // ?optimization=disabled|basic|extended|all: onnxruntime-web's graph optimization, for
  // profiling the session creation (docs/web.md); its default ("all") otherwise.
  const options = {};
  if (params.get("optimization")) options.graphOptimizationLevel = params.get("optimization");
  const { model, session, downloaded } = await createSession(ort, site.model, params, options);
  // One token on a one-token input: onnxruntime-web sets up the loop's kernels and buffers on
  // the first run (several times a translation's time), so that the first translation does not.
  await generate({ ort, session, site }, [[site.pad_token_id ?? 0]], 1);
  const ready = performance.now();
  $("progress").hidden = true;
  const timings = {
    download_ms: downloaded - started,
    session_ms: ready - downloaded, // session creation and the warm-up run
    load_ms: ready - started,
    ready_ms: ready, // since the navigation started
    model_bytes: model.length,
    threads: ort.env.wasm.numThreads,
    graph_optimization: options.graphOptimizationLevel ?? "all",
    cross_origin_isolated: crossOriginIsolated,
  };
  $("status").textContent = readyText(timings);
  return { ort, tokenizer, session, site, timings };
}

function int64Tensor(ort, rows, width, fill) {
  const data = new BigInt64Array(rows.length * width).fill(BigInt(fill));
  rows.forEach((row, r) => row.forEach((v, c) => (data[r * width + c] = BigInt(v))));
  return new ort.Tensor("int64", data, [rows.length, width]);
}

// Rows of token ids, padded on the right as the Python tokenizer pads, in; sequences out.
async function generate(app, ids, maxNewTokens = app.site.max_new_tokens) {
  const { ort, session, site } = app;
  const width = Math.max(...ids.map((row) => row.length));
  const feeds = {
    input_ids: int64Tensor(ort, ids, width, site.pad_token_id),
    attention_mask: int64Tensor(ort, ids.map((row) => row.map(() => 1)), width, 0),
    max_new_tokens: new ort.Tensor("int64", BigInt64Array.from([BigInt(maxNewTokens)]), []),
  };
  return runSequences(session, feeds);
}

async function translate(app, texts) {
  const ids = texts.map((text) => app.tokenizer.encode(text).ids);
  const { sequences, ms } = await generate(app, ids);
  const outputs = sequences.map((row) => app.tokenizer.decode(row, { skip_special_tokens: true }));
  return { ids, sequences, texts: outputs, ms };
}

const app = await start(load, { translate, generate });
if (app) {
  $("source").value = (app.site.examples ?? []).join("\n");
  $("translate").disabled = false;
  $("translate").addEventListener("click", async () => {
    const texts = $("source").value.split("\n").map((t) => t.trim()).filter(Boolean);
    if (!texts.length) return;
    $("translate").disabled = true;
    try {
      const last = await translate(app, texts);
      window.onnxmerge.last = last;
      $("output").textContent = last.texts.join("\n");
      $("timing").textContent =
        `Translated ${texts.length} sentence${texts.length > 1 ? "s" : ""} in ${last.ms.toFixed(0)} ms ` +
        `(${(last.ms / texts.length).toFixed(0)} ms per sentence).`;
    } catch (error) {
      $("output").textContent = "";
      $("timing").textContent = "";
      showError(`Translation failed: ${error.message}`);
    } finally {
      $("translate").disabled = !window.onnxmerge.app;
    }
  });
}
document.body.dataset.state = app ? "ready" : "failed";
