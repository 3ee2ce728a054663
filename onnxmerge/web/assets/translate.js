// Loads site.json, the tokenizer and the generator model, then translates what is typed.
// The generator model holds the whole decoding loop: one session.run turns token ids into
// token ids, so no generation code lives here.

const $ = (id) => document.getElementById(id);

function showError(message) {
  $("status").textContent = message;
  $("status").className = "error";
  $("progress").hidden = true;
  $("translate").disabled = true;
}

// What onnxruntime-web's wasm backend needs; null when the browser has it all.
function missingFeature() {
  if (typeof WebAssembly !== "object" || typeof WebAssembly.validate !== "function") {
    return "WebAssembly";
  }
  // onnxruntime-web ships SIMD builds only: a module with one v128 instruction must validate.
  const simd = new Uint8Array([
    0, 97, 115, 109, 1, 0, 0, 0, 1, 5, 1, 96, 0, 1, 123, 3, 2, 1, 0, 10, 10, 1, 8, 0, 65, 0, 253,
    15, 253, 98, 11,
  ]);
  if (!WebAssembly.validate(simd)) return "WebAssembly SIMD";
  if (typeof BigInt64Array !== "function") return "64-bit integer arrays (BigInt64Array)";
  if (typeof fetch !== "function") return "fetch";
  return null;
}

async function fetchBytes(url, onProgress) {
  const response = await fetch(url);
  if (!response.ok) throw new Error(`${url}: HTTP ${response.status}`);
  const total = Number(response.headers.get("Content-Length")) || 0;
  if (!response.body) return new Uint8Array(await response.arrayBuffer());
  const reader = response.body.getReader();
  const chunks = [];
  let received = 0;
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    chunks.push(value);
    received += value.length;
    onProgress(received, total);
  }
  const bytes = new Uint8Array(received);
  let offset = 0;
  for (const chunk of chunks) {
    bytes.set(chunk, offset);
    offset += chunk.length;
  }
  return bytes;
}

async function fetchJson(url) {
  const response = await fetch(url);
  if (!response.ok) throw new Error(`${url}: HTTP ${response.status}`);
  return response.json();
}

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

const mb = (n) => `${(n / 1e6).toFixed(1)} MB`;

async function load() {
  const missing = missingFeature();
  if (missing) {
    showError(`This browser lacks ${missing}, which the translator needs: use a current Chrome, Edge, Firefox or Safari.`);
    return null;
  }
  let ort;
  let Tokenizer;
  try {
    ort = await import("onnxruntime-web");
    ({ Tokenizer } = await import("@huggingface/tokenizers"));
  } catch (error) {
    showError(
      `Could not load the JavaScript libraries (${error.message}). ` +
        "Run `npm install --ignore-scripts` in the site folder, and serve the folder with node_modules.",
    );
    return null;
  }
  const started = performance.now();
  const site = await fetchJson("site.json");
  const [tokenizerJson, tokenizerConfig] = await Promise.all([
    fetchJson("tokenizer.json"),
    fetchJson("tokenizer_config.json"),
  ]);
  const tokenizer = new Tokenizer(tokenizerJson, tokenizerConfig);
  applyMetaspaceSplit(tokenizer.pre_tokenizer, tokenizerJson.pre_tokenizer);

  const params = new URLSearchParams(location.search);
  // Several threads need SharedArrayBuffer, which only a cross-origin isolated page has.
  const threads = Number(params.get("threads")) || (crossOriginIsolated ? Math.min(4, navigator.hardwareConcurrency || 1) : 1);
  ort.env.wasm.numThreads = threads;
  const progress = $("progress");
  const model = await fetchBytes(site.model, (received, total) => {
    if (total) progress.value = received / total;
    $("status").textContent = `Downloading the model: ${mb(received)}${total ? ` of ${mb(total)}` : ""}`;
  });
  const downloaded = performance.now();
  $("status").textContent = "Preparing the model…";
  // ?optimization=disabled|basic|extended|all: onnxruntime-web's graph optimization, for
  // profiling the session creation (docs/web.md); its default ("all") otherwise.
  const options = { executionProviders: ["wasm"] };
  if (params.get("optimization")) options.graphOptimizationLevel = params.get("optimization");
  const session = await ort.InferenceSession.create(model, options);
  // One token on a one-token input: onnxruntime-web sets up the loop's kernels and buffers on
  // the first run (several times a translation's time), so that the first translation does not.
  await generate({ ort, session, site }, [[site.pad_token_id ?? 0]], 1);
  const ready = performance.now();
  progress.hidden = true;
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
  $("status").textContent =
    `Ready: ${mb(model.length)} model loaded in ${(timings.load_ms / 1000).toFixed(2)} s ` +
    `(session ${(timings.session_ms / 1000).toFixed(2)} s, ${timings.threads} thread${timings.threads > 1 ? "s" : ""}).`;
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
  const started = performance.now();
  const result = await session.run(feeds);
  const ms = performance.now() - started;
  const { dims, data } = result.sequences;
  const values = Array.from(data, Number);
  const sequences = Array.from({ length: dims[0] }, (_, r) => values.slice(r * dims[1], (r + 1) * dims[1]));
  return { sequences, ms };
}

async function translate(app, texts) {
  const ids = texts.map((text) => app.tokenizer.encode(text).ids);
  const { sequences, ms } = await generate(app, ids);
  const outputs = sequences.map((row) => app.tokenizer.decode(row, { skip_special_tokens: true }));
  return { ids, sequences, texts: outputs, ms };
}

const app = await load().catch((error) => {
  showError(`The model could not be loaded: ${error.message}`);
  return null;
});
window.onnxmerge = {
  app,
  last: null,
  translate: app ? (texts) => translate(app, texts) : null,
  generate: app ? (ids, maxNewTokens) => generate(app, ids, maxNewTokens) : null,
};
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
