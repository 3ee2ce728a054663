// What both pages share: the browser check, the downloads with progress, the wasm session and
// the run that returns the generated sequences. Each page's own module imports it.

export const $ = (id) => document.getElementById(id);

export const mb = (n) => `${(n / 1e6).toFixed(1)} MB`;

export function showError(message) {
  $("status").textContent = message;
  $("status").className = "error";
  $("progress").hidden = true;
}

// What onnxruntime-web's wasm backend needs; null when the browser has it all.
export function missingFeature() {
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

export async function fetchJson(url) {
  const response = await fetch(url);
  if (!response.ok) throw new Error(`${url}: HTTP ${response.status}`);
  return response.json();
}

// The npm packages, in the order named; null once the page says how to install them.
export async function importPackages(...names) {
  try {
    return await Promise.all(names.map((name) => import(name)));
  } catch (error) {
    showError(
      `Could not load the JavaScript libraries (${error.message}). ` +
        "Run `npm install --ignore-scripts` in the site folder, and serve the folder with node_modules.",
    );
    return null;
  }
}

// Downloads the model with the progress bar and creates its wasm session; ?threads=N overrides
// the thread count.
export async function createSession(ort, url, params, options = {}) {
  // Several threads need SharedArrayBuffer, which only a cross-origin isolated page has.
  const threads = Number(params.get("threads")) || (crossOriginIsolated ? Math.min(4, navigator.hardwareConcurrency || 1) : 1);
  ort.env.wasm.numThreads = threads;
  const progress = $("progress");
  const model = await fetchBytes(url, (received, total) => {
    if (total) progress.value = received / total;
    $("status").textContent = `Downloading the model: ${mb(received)}${total ? ` of ${mb(total)}` : ""}`;
  });
  const downloaded = performance.now();
  $("status").textContent = "Preparing the model…";
  const session = await ort.InferenceSession.create(model, { executionProviders: ["wasm"], ...options });
  return { model, session, downloaded };
}

export function readyText(timings) {
  return (
    `Ready: ${mb(timings.model_bytes)} model loaded in ${(timings.load_ms / 1000).toFixed(2)} s ` +
    `(session ${(timings.session_ms / 1000).toFixed(2)} s, ${timings.threads} thread${timings.threads > 1 ? "s" : ""}).`
  );
}

// One session.run; the generated rows as arrays of numbers, and its time.
export async function runSequences(session, feeds) {
  const started = performance.now();
  const result = await session.run(feeds);
  const ms = performance.now() - started;
  const { dims, data } = result.sequences;
  const values = Array.from(data, Number);
  const sequences = Array.from({ length: dims[0] }, (_, r) => values.slice(r * dims[1], (r + 1) * dims[1]));
  return { sequences, ms };
}

// Runs the page's load and publishes window.onnxmerge: the app, the last result and the page's
// script API (each function called with the app first; null when the load failed).
export async function start(load, api) {
  const app = await load().catch((error) => {
    showError(`The model could not be loaded: ${error.message}`);
    return null;
  });
  window.onnxmerge = { app, last: null };
  for (const [name, fn] of Object.entries(api)) {
    window.onnxmerge[name] = app ? (...args) => fn(app, ...args) : null;
  }
  return app;
}
