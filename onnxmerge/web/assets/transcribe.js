// Loads site.json, the tokenizer (when there is one) and the audio generator model, then
// transcribes a file or the microphone. The model computes Whisper's log-mel features and runs
// the whole decoding loop: the page only decodes the audio to 16 kHz mono and makes one
// session.run.

const $ = (id) => document.getElementById(id);

function showError(message) {
  $("status").textContent = message;
  $("status").className = "error";
  $("progress").hidden = true;
}

// What onnxruntime-web's wasm backend and the page need; null when the browser has it all.
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
  if (typeof OfflineAudioContext !== "function") return "Web Audio (OfflineAudioContext)";
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

const mb = (n) => `${(n / 1e6).toFixed(1)} MB`;

async function load() {
  const missing = missingFeature();
  if (missing) {
    showError(`This browser lacks ${missing}, which the page needs: use a current Chrome, Edge, Firefox or Safari.`);
    return null;
  }
  let ort;
  const site = await fetchJson("site.json");
  let tokenizer = null;
  try {
    ort = await import("onnxruntime-web");
    if (site.tokenizer) {
      const { Tokenizer } = await import("@huggingface/tokenizers");
      const [json, config] = await Promise.all([fetchJson("tokenizer.json"), fetchJson("tokenizer_config.json")]);
      tokenizer = new Tokenizer(json, config);
    }
  } catch (error) {
    showError(
      `Could not load the JavaScript libraries (${error.message}). ` +
        "Run `npm install --ignore-scripts` in the site folder, and serve the folder with node_modules.",
    );
    return null;
  }
  const started = performance.now();
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
  const session = await ort.InferenceSession.create(model, { executionProviders: ["wasm"] });
  const ready = performance.now();
  progress.hidden = true;
  const timings = {
    download_ms: downloaded - started,
    session_ms: ready - downloaded,
    load_ms: ready - started,
    model_bytes: model.length,
    threads: ort.env.wasm.numThreads,
    cross_origin_isolated: crossOriginIsolated,
  };
  const readyText =
    `Ready: ${mb(model.length)} model loaded in ${(timings.load_ms / 1000).toFixed(2)} s ` +
    `(session ${(timings.session_ms / 1000).toFixed(2)} s, ${timings.threads} thread${timings.threads > 1 ? "s" : ""}).`;
  $("status").textContent = readyText;
  return { ort, tokenizer, session, site, timings, readyText };
}

// Encoded audio (any format the browser decodes) to mono samples at the model's rate: the
// OfflineAudioContext resamples while it decodes; channels are averaged, as a down-mix does.
async function decodeAudio(app, bytes) {
  const rate = app.site.audio.sampling_rate;
  const context = new OfflineAudioContext(1, 1, rate);
  let buffer;
  try {
    buffer = await context.decodeAudioData(bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.byteLength));
  } catch (error) {
    throw new Error(`the browser cannot decode this file as audio (${error.message || error})`);
  }
  const samples = new Float32Array(buffer.length);
  for (let c = 0; c < buffer.numberOfChannels; c++) {
    const channel = buffer.getChannelData(c);
    for (let i = 0; i < samples.length; i++) samples[i] += channel[i] / buffer.numberOfChannels;
  }
  return { samples, channels: buffer.numberOfChannels, seconds: buffer.duration };
}

// The checks Python's prepare_audio makes, before onnxruntime runs.
function checkRows(app, rows, rate) {
  const wanted = app.site.audio.sampling_rate;
  if (rate !== wanted) {
    throw new Error(`the samples are at ${rate} Hz; the model reads ${wanted} Hz: resample them first (decodeAudio does)`);
  }
  if (!Array.isArray(rows) || rows.length === 0) throw new Error("give at least one row of samples");
  rows.forEach((row, r) => {
    if (!(row instanceof Float32Array)) {
      throw new Error(`row ${r} is not a Float32Array of mono samples (for stereo, average the channels)`);
    }
    if (row.length === 0) throw new Error(`row ${r} has no samples`);
    if (!row.every(Number.isFinite)) throw new Error(`row ${r} holds NaN or infinite samples`);
  });
}

// Rows of mono samples at the model's rate in; token ids (and texts, with a tokenizer) out.
async function transcribe(app, rows, rate = app.site.audio.sampling_rate, maxNewTokens = app.site.max_new_tokens) {
  checkRows(app, rows, rate);
  const { ort, session, site } = app;
  const lengths = rows.map((row) => Math.min(row.length, site.audio.n_samples));
  const width = Math.max(...lengths);
  const audio = new Float32Array(rows.length * width);
  rows.forEach((row, r) => audio.set(row.subarray(0, lengths[r]), r * width));
  const feeds = {
    audio: new ort.Tensor("float32", audio, [rows.length, width]),
    audio_lengths: new ort.Tensor("int64", BigInt64Array.from(lengths, BigInt), [rows.length]),
    max_new_tokens: new ort.Tensor("int64", BigInt64Array.from([BigInt(maxNewTokens)]), []),
  };
  const started = performance.now();
  const result = await session.run(feeds);
  const ms = performance.now() - started;
  const { dims, data } = result.sequences;
  const values = Array.from(data, Number);
  const sequences = Array.from({ length: dims[0] }, (_, r) => values.slice(r * dims[1], (r + 1) * dims[1]));
  const generated = sequences.map((row) => row.slice(site.prompt_length));
  const texts = app.tokenizer
    ? generated.map((row) => app.tokenizer.decode(row, { skip_special_tokens: true }).trim())
    : generated.map((row) => `token ids: ${row.join(" ")}`);
  return { sequences, texts, ms };
}

async function transcribeBytes(app, bytes) {
  const decoded = await decodeAudio(app, bytes);
  if (decoded.samples.length === 0) throw new Error("the file holds no audio");
  const result = await transcribe(app, [decoded.samples]);
  return { ...result, channels: decoded.channels, seconds: decoded.seconds };
}

function show(last) {
  window.onnxmerge.last = last;
  $("output").textContent = last.texts.join("\n");
  const window_s = window.onnxmerge.app.site.audio.n_samples / window.onnxmerge.app.site.audio.sampling_rate;
  const notes = [];
  if (last.channels > 1) notes.push(`${last.channels} channels mixed to mono`);
  if (last.seconds > window_s) notes.push(`only the first ${window_s} s transcribed`);
  $("timing").textContent =
    `Transcribed ${last.seconds?.toFixed(1) ?? "?"} s of audio in ${last.ms.toFixed(0)} ms` +
    (notes.length ? ` (${notes.join("; ")}).` : ".");
}

async function guarded(button, work) {
  button.disabled = true;
  try {
    show(await work());
    $("status").textContent = window.onnxmerge.app.readyText;
    $("status").className = "";
  } catch (error) {
    $("output").textContent = "";
    $("timing").textContent = "";
    showError(`Transcription failed: ${error.message}`);
  } finally {
    button.disabled = false;
  }
}

function setUpMicrophone(app) {
  const button = $("record");
  if (!navigator.mediaDevices?.getUserMedia || typeof MediaRecorder !== "function") {
    button.title = "This browser does not let the page record (it needs https or localhost).";
    return;
  }
  button.disabled = false;
  let recorder = null;
  button.addEventListener("click", async () => {
    if (recorder) {
      recorder.stop();
      return;
    }
    let stream;
    try {
      stream = await navigator.mediaDevices.getUserMedia({ audio: true });
    } catch (error) {
      showError(`The microphone is not available: ${error.message}`);
      return;
    }
    const chunks = [];
    recorder = new MediaRecorder(stream);
    recorder.addEventListener("dataavailable", (event) => chunks.push(event.data));
    recorder.addEventListener("stop", () => {
      stream.getTracks().forEach((track) => track.stop());
      recorder = null;
      button.textContent = "Record from the microphone";
      guarded(button, async () => transcribeBytes(app, new Uint8Array(await new Blob(chunks).arrayBuffer())));
    });
    recorder.start();
    button.textContent = "Stop and transcribe";
  });
}

const app = await load().catch((error) => {
  showError(`The model could not be loaded: ${error.message}`);
  return null;
});
window.onnxmerge = {
  app,
  last: null,
  transcribe: app ? (rows, rate, maxNewTokens) => transcribe(app, rows, rate, maxNewTokens) : null,
  transcribeBytes: app ? (bytes) => transcribeBytes(app, bytes) : null,
};
if (app) {
  $("transcribe").disabled = false;
  $("transcribe").addEventListener("click", () => {
    const file = $("audio-file").files[0];
    if (!file) {
      showError("Choose an audio file first.");
      return;
    }
    guarded($("transcribe"), async () => transcribeBytes(app, new Uint8Array(await file.arrayBuffer())));
  });
  setUpMicrophone(app);
}
document.body.dataset.state = app ? "ready" : "failed";
