// The chat: streams through /v1/chat/completions with the tandem_token_sources
// extension and shows each token by how it was made. Model output is only ever
// set as text (textContent), never parsed as HTML.
"use strict";

const TandemChat = (() => {
  const SOURCES = {
    pld: "prompt lookup",
    draft: "draft model",
    mtp: "MTP head",
    dflash: "DFlash drafter",
    eagle3: "EAGLE-3 drafter",
    assistant: "assistant drafter",
    target: "target model",
  };

  function make(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text != null) node.textContent = text;
    return node;
  }

  // Split an SSE byte stream into the JSON of its `data:` lines.
  async function* sseData(response) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of block.split("\n")) {
          if (!line.startsWith("data: ")) continue; // comments: keep-alives
          const data = line.slice(6);
          if (data === "[DONE]") return;
          yield JSON.parse(data);
        }
      }
    }
  }

  async function errorText(response) {
    try {
      const body = await response.json();
      const message = body && body.error && body.error.message;
      return `${response.status}: ${message || response.statusText}`;
    } catch (e) {
      return `${response.status} ${response.statusText}`;
    }
  }

  function formatTotals(t) {
    const parts = [`${t.tokens} tokens`];
    if (t.drafted != null) {
      const share = t.drafted ? ` (${Math.round((100 * t.accepted) / t.drafted)}%)` : "";
      parts.push(`drafted ${t.drafted}`, `accepted ${t.accepted}${share}`);
    }
    if (t.tps != null) parts.push(`${t.tps.toFixed(1)} tok/s`);
    if (t.ttft != null) parts.push(`first token ${(t.ttft * 1000).toFixed(0)} ms`);
    return parts.join(" · ");
  }

  function init(options) {
    const form = document.getElementById("chat-form");
    const prompt = document.getElementById("prompt");
    const send = document.getElementById("send");
    const clear = document.getElementById("clear");
    const list = document.getElementById("messages");
    const hint = document.getElementById("chat-hint");
    const maxTokens = document.getElementById("max-tokens");
    const temperature = document.getElementById("temperature");
    let history = [];
    let busy = null; // the AbortController of the answer streaming now

    function addMessage(role, text) {
      const msg = make("div", `msg ${role}`);
      const bubble = make("div", "bubble", text);
      msg.appendChild(bubble);
      list.appendChild(msg);
      list.scrollTop = list.scrollHeight;
      return { msg, bubble };
    }

    function addToken(bubble, source, text) {
      const known = Object.prototype.hasOwnProperty.call(SOURCES, source);
      const span = make("span", `tok src-${known ? source : "target"}`, text);
      span.dataset.source = source;
      span.title = known ? SOURCES[source] : source;
      bubble.appendChild(span);
    }

    async function ask(text) {
      hint.classList.add("hidden");
      history.push({ role: "user", content: text });
      addMessage("user", text);
      const { msg, bubble } = addMessage("assistant", "");
      const totals = make("div", "totals", "…");
      msg.appendChild(totals);
      const body = {
        messages: history,
        stream: true,
        stream_options: { include_usage: true },
        tandem_token_sources: true,
        max_tokens: Number(maxTokens.value) || 256,
        temperature: Number(temperature.value) || 0,
      };
      const headers = { "Content-Type": "application/json" };
      const key = options.getKey();
      if (key) headers.Authorization = `Bearer ${key}`;
      busy = new AbortController();
      const sent = performance.now();
      let first = null;
      let last = null;
      let tokens = 0;
      let content = "";
      let speculation = null;
      let usage = null;
      try {
        const response = await fetch("/v1/chat/completions", {
          method: "POST",
          headers,
          body: JSON.stringify(body),
          signal: busy.signal,
        });
        if (response.status === 401) options.onUnauthorized();
        if (!response.ok) throw new Error(await errorText(response));
        for await (const chunk of sseData(response)) {
          if (chunk.error) throw new Error(chunk.error.message || "the request failed");
          if (chunk.usage) usage = chunk.usage;
          if (chunk.speculation) speculation = chunk.speculation;
          const choice = chunk.choices && chunk.choices[0];
          if (choice && choice.delta && typeof choice.delta.content === "string") {
            content += choice.delta.content;
          }
          for (const entry of chunk.token_sources || []) {
            const now = performance.now();
            if (first == null) first = now;
            last = now;
            tokens += 1;
            addToken(bubble, entry.source, entry.text);
          }
          list.scrollTop = list.scrollHeight;
        }
        history.push({ role: "assistant", content });
        const count = usage ? usage.completion_tokens : tokens;
        const span = first != null && last > first ? (last - first) / 1000 : null;
        totals.textContent = formatTotals({
          tokens: count,
          drafted: speculation ? speculation.draft_tokens : null,
          accepted: speculation ? speculation.accepted_tokens : null,
          tps: span && tokens > 1 ? (tokens - 1) / span : null,
          ttft: first != null ? (first - sent) / 1000 : null,
        });
        msg.dataset.done = "true";
      } catch (error) {
        history.pop();
        totals.className = "totals error";
        totals.textContent = error.name === "AbortError" ? "stopped" : String(error.message || error);
        msg.dataset.done = "error";
      } finally {
        busy = null;
        send.textContent = "Send";
      }
    }

    form.addEventListener("submit", (event) => {
      event.preventDefault();
      if (busy) {
        busy.abort();
        return;
      }
      const text = prompt.value.trim();
      if (!text) return;
      prompt.value = "";
      send.textContent = "Stop";
      ask(text);
    });
    prompt.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        form.requestSubmit();
      }
    });
    clear.addEventListener("click", () => {
      if (busy) busy.abort();
      history = [];
      for (const node of Array.from(list.querySelectorAll(".msg"))) node.remove();
      hint.classList.remove("hidden");
    });
  }

  return { init, SOURCES };
})();
