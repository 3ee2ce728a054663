// Loads site.json, the tokenizer (when there is one) and the audio generator model, then
// transcribes a file or the microphone. The model computes Whisper's log-mel features and runs
// the whole decoding loop: the page only decodes the audio to 16 kHz mono and makes one
// session.run.

import { $, createSession, fetchJson, importPackages, missingFeature, readyText, runSequences, showError, start } from "./page.js";

// The page decodes audio with Web Audio besides what the wasm backend needs.
function missingAudioFeature() {
  if (typeof OfflineAudioContext !== "function") return "Web Audio (OfflineAudioContext)";
  return null;
}

async function load() {
  const missing = missingFeature() ?? missingAudioFeature();
  if (missing) {
    showError(`This browser lacks ${missing}, which the page needs: use a current Chrome, Edge, Firefox or Safari.`);
    return null;
  }
  const site = await fetchJson("site.json");
  const packages = await importPackages("onnxruntime-web", ...(site.tokenizer ? ["@huggingface/tokenizers"] : []));
  if (!packages) return null;
  const [ort, tokenizers] = packages;
  let tokenizer = null;
  if (tokenizers) {
    const [json, config] = await Promise.all([fetchJson("tokenizer.json"), fetchJson("tokenizer_config.json")]);
    tokenizer = new tokenizers.Tokenizer(json, config);
  }
  const started = performance.now();
  const params = new URLSearchParams(location.search);
  const { model, session, downloaded } = await createSession(ort, site.model, params);
  const ready = performance.now();
  $("progress").hidden = true;
  const timings = {
    download_ms: downloaded - started,
    session_ms: ready - downloaded,
    load_ms: ready - started,
    model_bytes: model.length,
    threads: ort.env.wasm.numThreads,
    cross_origin_isolated: crossOriginIsolated,
  };
  $("status").textContent = readyText(timings);
  return { ort, tokenizer, session, site, timings };
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
  const { sequences, ms } = await runSequences(session, feeds);
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
    $("status").textContent = readyText(window.onnxmerge.app.timings);
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

const app = await start(load, { transcribe, transcribeBytes });
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
