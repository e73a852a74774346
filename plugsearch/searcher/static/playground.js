// plugsearch playground: runs one search over the server-sent events of POST /search (stream: true) and
// naive top-k for the same question and budget, and shows both; each returned document can be marked "Helped" /
// "Did not help" (POST /feedback, the answer's search_id). Plain browser JavaScript, no dependencies; it talks
// only to the searcher that served it. The API key lives in the form field, nowhere else.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const API = "search"; // relative: the searcher that served this page (also behind a path prefix)
  const FEEDBACK = "feedback";
  const SNIPPET_CHARS = 140;

  const STOP_REASONS = {
    complete: "the policy said the search was complete",
    max_turns: "the turn limit was reached",
    invalid_actions: "the policy wrote too many invalid actions in a row",
    policy_error: "the policy LLM failed",
    policy_timeout: "the policy LLM timed out",
    retriever_error: "the retriever failed during the search",
    deadline: "the search ran out of time",
    naive: "naive retrieval (no policy)",
  };

  let controller = null; // the running search's AbortController (Stop, or a new search, aborts it)
  let view = null; // what the current search has shown so far

  // ------------------------------------------------------------------------------------------ DOM helpers
  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs)) {
      if (value === null || value === undefined || value === false) continue;
      if (name === "class") node.className = value;
      else if (name === "dataset") Object.assign(node.dataset, value);
      else node.setAttribute(name, value === true ? "" : String(value));
    }
    for (const child of children.flat(Infinity)) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  const ms = (value) => (value >= 1000 ? `${(value / 1000).toFixed(1)} s` : `${Math.round(value)} ms`);
  const oneLine = (text) => text.split(/\s+/).filter(Boolean).join(" ");
  const calls = (n) => `${n} call${n === 1 ? "" : "s"}`;

  // The response's retrieval time is summed over its retrieval calls, and some run at once (s3's first pool
  // asks each method together), so the sum can pass the total: say it is a sum, and when it overlapped.
  function retrievalTime(t) {
    if (t.retrieval_calls <= 1) return `retrieval ${ms(t.retrieval_ms)}`;
    const overlapped = t.retrieval_ms + t.policy_ms > t.total_ms;
    return `retrieval ${ms(t.retrieval_ms)} summed over ${calls(t.retrieval_calls)}${overlapped ? ", some concurrent" : ""}`;
  }

  function say(text) { $("status").textContent = text; }

  function showError(text) {
    const box = $("error");
    box.textContent = text;
    box.hidden = !text;
  }

  // ---------------------------------------------------------------------------------------------- HTTP
  function headers(stream) {
    const out = { "Content-Type": "application/json", Accept: stream ? "text/event-stream" : "application/json" };
    const key = $("api-key").value.trim();
    if (key) out.Authorization = `Bearer ${key}`;
    return out;
  }

  class SearchFailed extends Error {
    constructor(message, status) {
      super(message);
      this.status = status;
    }
  }

  // An error answer (the error envelope) in words a person can act on.
  async function failure(response) {
    let detail = "";
    try {
      const body = await response.json();
      detail = (body && body.error && body.error.message) || "";
    } catch (_) {
      detail = response.statusText || "";
    }
    const retry = response.headers.get("Retry-After");
    const later = retry ? ` Try again in ${retry} s.` : " Try again shortly.";
    const words = {
      400: `The searcher refused the request: ${detail}`,
      401: "This searcher requires an API key. Enter it in the API key field and search again.",
      403: `This key may not do that: ${detail}`,
      404: `The searcher does not know this search any more: ${detail}`,
      409: `The searcher keeps no marks: ${detail}`,
      413: "The question is too long.",
      422: `The request is not valid: ${detail}`,
      429: `The searcher is busy (too many requests at once).${later}`,
      502: `An upstream service of the searcher failed: ${detail}.${later}`,
      503: `The searcher cannot search right now (not ready, or its retriever is unavailable): ${detail}.${later}`,
      504: "The search took longer than the searcher allows. Try fewer turns, or try again.",
    }[response.status];
    return new SearchFailed(words || `The searcher answered ${response.status}: ${detail}`, response.status);
  }

  async function post(body, { stream, signal }) {
    let response;
    try {
      response = await fetch(API, { method: "POST", headers: headers(stream), body: JSON.stringify(body), signal });
    } catch (error) {
      if (error.name === "AbortError") throw error;
      throw new SearchFailed(`Could not reach the searcher (${error.message}). Is it still running?`, 0);
    }
    if (!response.ok) throw await failure(response);
    return response;
  }

  // Server-sent events of a fetch response: yields {event, data} as they arrive.
  async function* events(response) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    let name = "";
    let data = [];
    for (;;) {
      const { value, done } = await reader.read();
      buffer += done ? decoder.decode() : decoder.decode(value, { stream: true });
      const lines = buffer.split(/\r\n|\r|\n/);
      buffer = done ? "" : lines.pop();
      for (const line of lines) {
        if (line === "") {
          if (data.length) yield { event: name || "message", data: data.join("\n") };
          name = "";
          data = [];
        } else if (!line.startsWith(":")) {
          const colon = line.indexOf(":");
          const field = colon < 0 ? line : line.slice(0, colon);
          let value = colon < 0 ? "" : line.slice(colon + 1);
          if (value.startsWith(" ")) value = value.slice(1);
          if (field === "event") name = value;
          else if (field === "data") data.push(value);
        }
      }
      if (done) return;
    }
  }

  // ----------------------------------------------------------------------------------------- documents
  // One document; long texts collapse into <details> (Enter or Space on the summary opens it).
  function docItem(doc, rank, { selected = false, note = null } = {}) {
    const text = oneLine(doc.text || "");
    const snippet = text.length > SNIPPET_CHARS ? `${text.slice(0, SNIPPET_CHARS)}…` : text;
    const summary = el("summary", {},
      el("span", { class: "rank" }, `${rank}.`), " ",
      el("span", { class: "title" }, doc.title || doc.id),
      el("span", { class: "badge selected", hidden: !selected }, "selected"),
      el("span", { class: "badge both", hidden: true }, "in both"),
      snippet ? [" ", el("span", { class: "snippet" }, `— ${snippet}`)] : null);
    const meta = [`id ${doc.id}`];
    if (typeof doc.score === "number") meta.push(`score ${doc.score.toFixed(3)}`);
    if (doc.query !== undefined) meta.push(`query “${doc.query}”`);
    const body = text ? el("p", { class: "text" }, text) : el("p", { class: "text" }, note || "");
    return el("li", { class: "doc", dataset: { docId: doc.id, selected: String(selected), rank: String(rank) } },
      el("details", {}, summary, body, el("p", { class: "meta" }, meta.join(" · "))));
  }

  function setSelected(item, selected) {
    item.dataset.selected = String(selected);
    item.querySelector(".badge.selected").hidden = !selected;
  }

  // ---------------------------------------------------------------------------------------------- turns
  // One card per block of documents: its query, the documents the policy selected from it, and the rest
  // (all of a block until the policy selects) as a count that opens into the list, so that a search over a
  // pool of 30 documents per block stays a few lines per turn.
  function turnCard(block, turn, queries, method, elapsedMs) {
    const what = turn === 0 ? "naive retrieval of the question" : "search";
    const heading = `Turn ${turn}: ${what}${method ? ` (${method})` : ""}`;
    const rest = el("details", { class: "rest" }, el("summary", {}), el("ol", { class: "docs", "aria-label": `Other documents retrieved in turn ${turn}` }));
    const card = el("li", { class: "turn", dataset: { block: String(block), turn: String(turn) } },
      el("header", {},
        el("h3", {}, heading),
        el("p", { class: "queries" }, queries.length > 1 ? "Queries: " : "Query: ",
          queries.map((q, i) => [i ? ", " : "", el("q", {}, q)])),
        elapsedMs === null ? null : el("p", { class: "when" }, `arrived at ${ms(elapsedMs)}`),
        el("p", { class: "action", hidden: true })),
      el("ol", { class: "docs kept", "aria-label": `Documents selected in turn ${turn}` }),
      rest);
    $("turns").append(card);
    $("how").hidden = false;
    view.cards[block] = card;
    return card;
  }

  // The block's documents in their card: the selected ones in the open list, the others behind the count.
  function placeDocs(card, selectedKnown) {
    const kept = card.querySelector("ol.kept");
    const rest = card.querySelector("details.rest");
    const items = [...card.querySelectorAll("li.doc")].sort((a, b) => Number(a.dataset.rank) - Number(b.dataset.rank));
    const chosen = items.filter((item) => item.dataset.selected === "true");
    const others = items.filter((item) => item.dataset.selected !== "true");
    kept.replaceChildren(...chosen);
    kept.hidden = chosen.length === 0;
    rest.querySelector("ol").replaceChildren(...others);
    rest.hidden = others.length === 0;
    const n = others.length;
    rest.querySelector("summary").textContent = selectedKnown
      ? `${n} more document${n === 1 ? "" : "s"} retrieved, not selected (show)`
      : `${n} document${n === 1 ? "" : "s"} retrieved (show)`;
  }

  function onRetrieval(ev) {
    const card = turnCard(ev.block, ev.turn, ev.queries, ev.method, ev.elapsed_ms);
    const list = card.querySelector("details.rest ol");
    ev.documents.forEach((doc, i) => list.append(docItem(doc, i + 1)));
    placeDocs(card, false);
    for (const doc of ev.documents) view.known.set(doc.id, doc);
    say(`Turn ${ev.turn}: ${ev.documents.length} documents for ${ev.queries.map((q) => `“${q}”`).join(", ")}`);
  }

  function markBlock(block, selected) {
    const card = view.cards[block];
    if (!card) return;
    const chosen = new Set(selected || []);
    card.querySelectorAll("li.doc").forEach((item) => setSelected(item, chosen.has(Number(item.dataset.rank))));
    placeDocs(card, selected !== null && selected !== undefined);
  }

  function onAction(ev) {
    const words = {
      search: `searched ${ev.queries.map((q) => `“${q}”`).join(", ")}`,
      complete: "said the search is complete",
      select: "marked its last documents",
      invalid: "wrote an invalid action (re-prompted)",
      duplicate: "repeated an earlier query (re-prompted)",
    }[ev.kind] || ev.kind;
    const marked = ev.selected && ev.selected.length ? `marked ${ev.selected.join(", ")}; ` : "";
    if (ev.block !== null && ev.block !== undefined) markBlock(ev.block, ev.selected);
    const card = view.cards[view.cards.length - 1];
    if (card) {
      const line = card.querySelector(".action");
      line.hidden = false;
      line.textContent = `Policy, step ${ev.step} (${ms(ev.elapsed_ms)}): ${marked}${words}`;
    }
    say(`Step ${ev.step}: the policy ${marked}${words}`);
  }

  // The final trace is the reference: blocks the stream did not show (a cached result) are drawn from it,
  // and every block's selection is set from it.
  function applyTrace(trace, documents) {
    for (const doc of documents) if (!view.known.has(doc.id)) view.known.set(doc.id, doc);
    trace.blocks.forEach((block, i) => {
      if (!view.cards[i]) {
        const card = turnCard(i, block.turn, block.queries, block.method, null);
        const list = card.querySelector("details.rest ol");
        block.document_ids.forEach((id, j) => {
          const doc = view.known.get(id) || { id, title: id, text: "" };
          list.append(docItem(doc, j + 1, { note: "(text not in the trace: not returned by the search)" }));
        });
      }
      markBlock(i, block.selected);
    });
  }

  // ------------------------------------------------------------------------------------------- marks
  // Two toggle buttons per returned document (aria-pressed): Helped / Did not help. Each change sends the whole
  // mark of the search (every document's state) to POST /feedback, one request after another, so the searcher keeps
  // the last one (a mark replaces the earlier one).
  const MARK_LABELS = { helpful: "Helped", not_helpful: "Did not help" };

  function markControls(doc) {
    const group = el("div", { class: "marks", role: "group", "aria-label": `Did “${doc.title || doc.id}” help?` });
    for (const [kind, label] of Object.entries(MARK_LABELS)) {
      const button = el("button", { type: "button", class: `mark ${kind === "helpful" ? "helped" : "not-helped"}`,
        "aria-pressed": "false", dataset: { mark: kind, docId: doc.id } }, label);
      button.addEventListener("click", () => toggleMark(doc.id, kind));
      group.append(button);
    }
    return group;
  }

  function toggleMark(id, kind) {
    if (!view || !view.result || !view.result.search_id) return;
    view.marks.set(id, view.marks.get(id) === kind ? null : kind);
    document.querySelectorAll(`#final-docs button.mark`).forEach((button) => {
      if (button.dataset.docId === id) button.setAttribute("aria-pressed", String(view.marks.get(id) === button.dataset.mark));
    });
    const mark = { search_id: view.result.search_id, helpful: [], not_helpful: [] };
    for (const [doc, state] of view.marks) if (state) mark[state].push(doc);
    const searchView = view;
    view.sending = view.sending.then(() => sendMark(mark, searchView));
  }

  function markStatus(text, state) {
    const status = $("mark-status");
    status.textContent = text;
    status.dataset.state = state;
  }

  async function sendMark(mark, searchView) {
    if (searchView !== view) return; // a new search started: its marks are its own
    if (!mark.helpful.length && !mark.not_helpful.length) {
      markStatus("Nothing marked now (the mark saved last stays until you mark again).", "idle");
      return;
    }
    markStatus("Saving your mark…", "saving");
    let response;
    try {
      response = await fetch(FEEDBACK, { method: "POST", headers: headers(false), body: JSON.stringify(mark) });
    } catch (error) {
      markStatus(`The mark was not saved: could not reach the searcher (${error.message}).`, "error");
      return;
    }
    if (searchView !== view) return;
    if (!response.ok) {
      markStatus(`The mark was not saved. ${(await failure(response)).message}`, "error");
      return;
    }
    const saved = await response.json();
    const n = (list) => `${list.length} document${list.length === 1 ? "" : "s"}`;
    markStatus(`Mark saved${saved.replaced ? " (it replaces your earlier one)" : ""}: ${n(saved.helpful)} helped, ${n(saved.not_helpful)} did not.`, "saved");
  }

  // ----------------------------------------------------------------------------------------- the result
  // The ready-to-paste context, as the searcher formats it (plugsearch/searcher/parsing.format_documents).
  function formatContext(docs) {
    return docs.map((doc, i) => `Doc ${i + 1}(Title: ${doc.title}) ${oneLine(doc.text)}\n`).join("");
  }

  function onResult(result) {
    view.result = result;
    const budget = view.budget === null ? result.documents.length : view.budget;
    const docs = result.documents.slice(0, budget);
    view.context = docs.length === result.documents.length ? result.context : formatContext(docs);
    if (result.trace) applyTrace(result.trace, result.documents);
    const list = $("final-docs");
    list.replaceChildren(...docs.map((doc, i) => {
      const item = docItem(doc, i + 1);
      if (result.search_id) item.append(markControls(doc));
      return item;
    }));
    $("mark-help").hidden = !result.search_id;
    const over = result.documents.length - docs.length;
    if (over > 0) list.append(el("li", { class: "note" }, `${over} more returned beyond the budget (not in the context).`));
    $("context").textContent = view.context;
    $("final").hidden = false;
    const t = result.timings;
    const parts = [
      `Stopped: ${STOP_REASONS[result.stop_reason] || result.stop_reason}`,
      `${result.turns} policy step${result.turns === 1 ? "" : "s"}`,
      `${result.queries.length} quer${result.queries.length === 1 ? "y" : "ies"}`,
      `${result.documents.length} documents returned`,
      `total ${ms(t.total_ms)} (policy ${ms(t.policy_ms)} in ${calls(t.policy_calls)}, ${retrievalTime(t)})`,
    ];
    $("summary").replaceChildren(parts.join(" · "), result.cached ? el("span", { class: "badge cached" }, "cached") : "");
    $("summary").dataset.stopReason = result.stop_reason;
    const warning = $("degraded");
    warning.hidden = !result.degraded;
    warning.textContent = result.degraded
      ? `Degraded result: ${result.degraded_reason || STOP_REASONS[result.stop_reason]}. The documents shown are what the search gathered before that.`
      : "";
  }

  function onNaive(naive) {
    view.naive = naive;
    $("naive-docs").replaceChildren(...naive.documents.map((doc, i) => docItem(doc, i + 1)));
    $("naive-summary").textContent = `Top ${naive.documents.length} for the question itself · ${retrievalTime(naive.timings)}${naive.cached ? " · cached" : ""}`;
  }

  // Documents both sides return within the budget get the "in both" badge, on both sides.
  function markBoth() {
    if (!view.result || !view.naive) return;
    const budget = view.budget === null ? view.result.documents.length : view.budget;
    const mine = new Set(view.result.documents.slice(0, budget).map((d) => d.id));
    const theirs = new Set(view.naive.documents.map((d) => d.id));
    let both = 0;
    for (const [list, other] of [[$("final-docs"), theirs], [$("naive-docs"), mine]]) {
      list.querySelectorAll("li.doc").forEach((item) => {
        const shared = other.has(item.dataset.docId);
        item.dataset.both = String(shared);
        item.querySelector(".badge.both").hidden = !shared;
        if (list.id === "naive-docs" && shared) both += 1;
      });
    }
    $("naive-summary").append(` · ${both} of ${theirs.size} also returned by the searcher`);
  }

  // ------------------------------------------------------------------------------------------ one search
  function readForm() {
    const number = (id) => {
      const raw = $(id).value.trim();
      return raw === "" ? null : Number.parseInt(raw, 10);
    };
    return { question: $("question").value.trim(), mode: $("mode").value, budget: number("budget"), maxTurns: number("max-turns") };
  }

  function reset(form) {
    view = { cards: [], known: new Map(), result: null, naive: null, context: "", budget: form.budget, marks: new Map(),
             sending: Promise.resolve() };
    for (const id of ["turns", "final-docs", "naive-docs", "summary", "naive-summary", "context", "copy-status", "mark-status"]) $(id).replaceChildren();
    $("final").hidden = true;
    $("how").hidden = true;
    $("degraded").hidden = true;
    showError("");
  }

  async function runSearcher(form, signal) {
    const body = { question: form.question, mode: form.mode, stream: true, return_trace: true };
    if (form.maxTurns !== null) body.max_turns = form.maxTurns;
    const response = await post(body, { stream: true, signal });
    for await (const { event, data } of events(response)) {
      const payload = JSON.parse(data);
      if (event === "retrieval") onRetrieval(payload);
      else if (event === "action") onAction(payload);
      else if (event === "end") say(`Search ended: ${STOP_REASONS[payload.stop_reason] || payload.stop_reason}`);
      else if (event === "result") return onResult(payload);
      else if (event === "error") throw new SearchFailed(`The search failed after it started: ${payload.error.message}`, 0);
    }
    throw new SearchFailed("The connection closed before the search finished.", 0);
  }

  async function runNaive(form, k, signal) {
    const naive = await (await post({ question: form.question, mode: "naive", retrieve_k: k }, { stream: false, signal })).json();
    onNaive(naive);
  }

  async function search(event) {
    event.preventDefault();
    const form = readForm();
    if (!form.question) {
      showError("Type a question first.");
      $("question").focus();
      return;
    }
    if (form.budget !== null && !(form.budget >= 1 && form.budget <= 50)) {
      showError("The budget must be a number of documents between 1 and 50 (or empty).");
      $("budget").focus();
      return;
    }
    if (controller) controller.abort();
    controller = new AbortController();
    const { signal } = controller;
    reset(form);
    const results = $("results");
    results.dataset.state = "running";
    $("stop-button").disabled = false;
    say("Searching…");
    // With a budget both sides run at once; without one, naive top-k gets as many documents as the searcher returns.
    const naive = form.budget !== null ? runNaive(form, form.budget, signal) : null;
    // naive may fail first (e.g. the same 401): handled here at once, reported once below through the await
    if (naive) naive.catch(() => {});
    try {
      await runSearcher(form, signal);
      await (naive || runNaive(form, Math.min(50, Math.max(1, view.result.documents.length)), signal));
      markBoth();
      results.dataset.state = "done";
      say(`Done: ${STOP_REASONS[view.result.stop_reason] || view.result.stop_reason}; ${$("final-docs").querySelectorAll("li.doc").length} documents for your LLM.`);
    } catch (error) {
      if (error.name === "AbortError") {
        results.dataset.state = "stopped";
        say("Stopped: the searcher cancels the search.");
        return;
      }
      results.dataset.state = "error";
      say("The search did not finish.");
      showError(error.message);
      if (error.status === 401) $("api-key").focus();
      else $("error").focus();
    } finally {
      if (controller && controller.signal === signal) {
        controller = null;
        $("stop-button").disabled = true;
      }
    }
  }

  async function copyContext() {
    const text = view ? view.context : "";
    if (!text) return;
    try {
      await navigator.clipboard.writeText(text);
    } catch (_) { // no clipboard API (not a secure context): the old way
      const area = el("textarea", { class: "skip", "aria-hidden": "true" });
      area.value = text;
      document.body.append(area);
      area.select();
      document.execCommand("copy");
      area.remove();
    }
    $("copy-status").textContent = `Context copied (${text.length} characters).`;
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("search-form").addEventListener("submit", search);
    $("stop-button").addEventListener("click", () => controller && controller.abort());
    $("copy-button").addEventListener("click", copyContext);
    $("question").focus();
  });
})();
