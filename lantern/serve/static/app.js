// lantern serve's page: plain JS, no build step. Streams POST /v1/images/generations
// (server-sent events over fetch, since EventSource cannot POST) and shows previews, then the image.
"use strict";

const $ = (id) => document.getElementById(id);
let model = null;

async function getJSON(path) {
  const res = await fetch(path);
  if (!res.ok) throw new Error(`${path}: ${await errorMessage(res)}`);
  return res.json();
}

// A refusal's message: the API's JSON error, else (a proxy's page, a plain-text 500) the status and
// the start of the text, never a JSON parse error.
async function errorMessage(res) {
  const text = await res.text();
  try {
    return JSON.parse(text).error.message;
  } catch {
    return `HTTP ${res.status}${text.trim() ? ": " + text.trim().slice(0, 200) : ""}`;
  }
}

async function init() {
  const [info, methods] = await Promise.all([getJSON("/v1/model"), getJSON("/v1/methods")]);
  model = info;
  $("model-name").textContent = `${info.model} (${info.kind}, ${info.image_tokens} tokens per image)`;
  const c2i = info.kind === "c2i";
  $("label-row").hidden = !c2i;
  $("prompt-row").hidden = c2i;
  $("label").required = c2i;
  if (c2i) $("label").max = info.num_classes - 1;
  else $("prompt").maxLength = info.max_prompt_chars;
  // Emu3 guides with a negative prompt: its own shows as the placeholder, and an empty field sends none.
  $("negative-row").hidden = info.negative_prompt === null;
  if (info.negative_prompt !== null) {
    $("negative_prompt").placeholder = info.negative_prompt;
    $("negative_prompt").maxLength = info.max_prompt_chars;
  }
  for (const m of methods.methods) {
    const option = new Option(m.name + (m.lossless ? " (lossless)" : ""), m.name, m.default, m.default);
    $("method").add(option);
  }
  $("form").addEventListener("submit", (event) => { event.preventDefault(); run(); });
}

function requestBody(method) {
  const body = { method, seed: parseInt($("seed").value || "0", 10), stream: true, preview_every: 2 };
  if (model.kind === "c2i") body.label = parseInt($("label").value, 10);
  else body.prompt = $("prompt").value;
  if (model.negative_prompt !== null && $("negative_prompt").value.trim() !== "") {
    body.negative_prompt = $("negative_prompt").value;
  }
  for (const [id, parse] of [["temperature", parseFloat], ["top_k", (v) => parseInt(v, 10)], ["cfg_scale", parseFloat]]) {
    const value = $(id).value.trim();
    if (value === "") continue;
    // JSON has no Infinity or NaN: JSON.stringify would send null (the model's default) for 1e999.
    const number = parse(value);
    if (!Number.isFinite(number)) throw new Error(`${id}: not a finite number: ${value.slice(0, 40)}`);
    body[id] = number;
  }
  return body;
}

// Server-sent events from a fetch body: yields [event, data] per "event: ...\ndata: ...\n\n" block.
async function* events(stream) {
  const reader = stream.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      let name = "message", data = "";
      for (const line of block.split("\n")) {
        if (line.startsWith("event: ")) name = line.slice(7);
        else if (line.startsWith("data: ")) data += line.slice(6);
      }
      yield [name, JSON.parse(data)];
    }
  }
}

// One streamed request into a panel ("main" or "ar"); resolves to the final image's stats.
async function generate(body, panel) {
  const img = $(`image-${panel}`);
  img.dataset.final = "false";
  $(`tau-${panel}`).textContent = "–";
  $(`latency-${panel}`).textContent = "…";
  const res = await fetch("/v1/images/generations", {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
  });
  if (!res.ok) throw new Error(await errorMessage(res));
  let stats = null;
  for await (const [name, data] of events(res.body)) {
    if (name === "preview") {
      img.src = `data:image/png;base64,${data.b64_json}`;
      $(`latency-${panel}`).textContent = `${data.tokens_done} / ${model.image_tokens} tokens`;
    } else if (name === "image") {
      img.src = `data:image/png;base64,${data.b64_json}`;
      stats = data.stats;
      $(`tau-${panel}`).textContent = stats.tokens_per_forward.toFixed(2);
      $(`latency-${panel}`).textContent = `${stats.latency_seconds.toFixed(2)} s`;
      img.dataset.final = "true";
    } else if (name === "error") {
      throw new Error(data.error.message);
    }
  }
  if (stats === null) throw new Error("the stream ended without an image");
  return stats;
}

async function run() {
  const method = $("method").value;
  const compare = $("compare").checked;
  $("generate").disabled = true;
  $("status").className = "";
  $("status").textContent = "generating…";
  $("panel-ar").hidden = !compare;
  $("speedup").hidden = true;
  $("caption-main").textContent = method;
  try {
    // One after the other: each gets the batch alone, so the two latencies compare the methods.
    const ar = compare ? await generate(requestBody("ar"), "ar") : null;
    const main = await generate(requestBody(method), "main");
    if (ar) {
      const speedup = ar.latency_seconds / main.latency_seconds;
      $("speedup").textContent = `${method}: ${speedup.toFixed(2)}x the speed of ar (same seed)`;
      $("speedup").hidden = false;
    }
    $("status").textContent = "done";
  } catch (error) {
    $("status").className = "error";
    $("status").textContent = error.message;
  } finally {
    $("generate").disabled = false;
  }
}

init().catch((error) => { $("status").className = "error"; $("status").textContent = error.message; });
