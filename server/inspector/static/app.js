// The PrimeRL inspector page: reads /v1/inspect/* (the same JSON routes any client can call) and follows the
// bridge's event stream. No build step, no dependency. Elements carry data-testid / data-* attributes that the
// browser tests read (tests/integration/test_inspector_web.py).
//
// The stream is read with fetch(), not EventSource: EventSource cannot send an Authorization header, and a bearer
// token in a URL ends up in logs and history. The stream is standard SSE (retry:, id:, event:); this page honours
// retry: and resumes with Last-Event-ID itself, and reconnects whatever happened (bridge restarted, network gone).

const TOKEN_KEY = "primerl-inspector-token";
const ORIGINS = ["prompt", "env", "sampled", "forced", "draft_accepted", "resampled"];
const state = {
  token: sessionStorage.getItem(TOKEN_KEY) || "",
  me: null, // the last episode list's who-am-I fields (auth, tenant, admin ...)
  selected: null, // the episode id shown in the detail view
  tab: "episodes",
  boot: "", // the bridge process the stream last said hello from
  lastEventId: "",
  retryMs: 1000,
  streaming: false,
  pending: null, // a refresh scheduled by events (coalesced)
  changed: new Set(),
};

const $ = (sel, root = document) => root.querySelector(sel);

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined) continue;
    if (key.startsWith("data-")) node.setAttribute(key, String(value)); // data-healthy="false" is data too
    else if (value === false) continue;
    else if (key === "text") node.textContent = value;
    else if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  node.append(...children.filter((c) => c !== null && c !== undefined));
  return node;
}

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function api(path, params = {}) {
  const url = new URL(path, location.origin);
  for (const [k, v] of Object.entries(params)) if (v !== "" && v !== null && v !== undefined) url.searchParams.set(k, v);
  const headers = state.token ? { Authorization: `Bearer ${state.token}` } : {};
  let response;
  try {
    response = await fetch(url, { headers, cache: "no-store" });
  } catch {
    throw new ApiError(0, "cannot reach the bridge (it may be restarting); retrying as the live stream reconnects");
  }
  const body = await response.json().catch(() => ({}));
  if (!response.ok) throw new ApiError(response.status, body.error?.message || response.statusText);
  return body;
}

function say(text) {
  const box = $("[data-testid=message]");
  box.textContent = text || "";
  box.hidden = !text;
}

function explain(err) {
  if (err.status === 401) {
    return state.token
      ? `This token was not accepted (401 Unauthorized): ${err.message}`
      : "This bridge requires a token: enter your tenant's bearer token.";
  }
  if (err.status === 403) return `Not allowed with this token (403 Forbidden): ${err.message}`;
  return err.message;
}

// -- auth -----------------------------------------------------------------------------------------------------

function askToken(why) {
  $("[data-testid=token-form]").hidden = false;
  $("main").hidden = true;
  say(why);
  $("[data-testid=token-input]").focus();
}

function setToken(token) {
  state.token = token;
  if (token) sessionStorage.setItem(TOKEN_KEY, token);
  else sessionStorage.removeItem(TOKEN_KEY);
}

async function start() {
  try {
    await loadEpisodes();
  } catch (err) {
    if (err.status === 401 || err.status === 403) return askToken(explain(err));
    say(explain(err));
  }
  $("[data-testid=token-form]").hidden = true;
  $("main").hidden = false;
  if (!state.streaming) follow();
}

// -- episodes -------------------------------------------------------------------------------------------------

function filters() {
  return Object.fromEntries(new FormData($("[data-testid=filters]")).entries());
}

function short(id) {
  return id.length > 14 ? `${id.slice(0, 11)}…` : id;
}

function when(unix) {
  return unix ? new Date(unix * 1000).toLocaleTimeString() : "";
}

async function loadEpisodes() {
  const body = await api("/v1/inspect/episodes", filters());
  state.me = body;
  say("");
  $("[data-testid=auth-off-banner]").hidden = body.auth;
  $("[data-testid=change-token]").hidden = !body.auth;
  $("[data-testid=whoami]").textContent = body.auth ? `tenant ${body.tenant}${body.admin ? " (admin)" : ""}` : "";
  $("[data-testid=tenant-filter]").hidden = !body.every_tenant;
  const k = body.kept;
  $("[data-testid=kept]").textContent =
    `policy v${body.policy_version} · kept ${k.ended} ended (${(k.bytes / 2 ** 20).toFixed(1)} MiB of ` +
    `${(k.max_ended_bytes / 2 ** 20).toFixed(0)}), ${k.evicted} evicted`;
  const rows = body.episodes.map((e) =>
    el(
      "tr",
      {
        "data-testid": "episode-row", "data-id": e.id, "data-status": e.status, "data-tenant": e.tenant,
        "data-group": e.group_id, "data-session": e.session_id, class: e.id === state.selected ? "selected" : "",
        onclick: () => select(e.id),
      },
      el("td", { class: "mono", title: e.id, text: short(e.id) }),
      el("td", { text: e.tenant || "—" }),
      el("td", { class: `status-${e.status}`, text: e.status }),
      el("td", { class: "mono", title: e.group_id, text: `${short(e.group_id)} #${e.group_index}` }),
      el("td", { class: "mono", text: e.session_id ? `${e.session_id} · b${e.branch}` : "" }),
      el("td", { text: e.turns }),
      el("td", { text: e.tokens }),
      el("td", { text: e.sampled_tokens }),
      el("td", { text: e.policy_versions.length ? `v${e.policy_versions[0]}–v${e.policy_versions[1]}` : "" }),
      el("td", { text: e.replica }),
      el("td", { text: when(e.started_at) }),
      el("td", { text: e.rewards && e.rewards.length ? e.rewards.map((r) => r.toFixed(3)).join(", ") : "" }),
    ),
  );
  $("[data-testid=episode-list]").replaceChildren(...rows);
}

async function select(id) {
  state.selected = id;
  for (const tr of document.querySelectorAll("[data-testid=episode-row]")) {
    tr.classList.toggle("selected", tr.dataset.id === id);
  }
  await loadDetail();
}

// -- one episode ----------------------------------------------------------------------------------------------

function heat(lp) {
  // probability 0 -> red, 0.5 -> yellow, 1 -> pale green
  const p = Math.exp(lp);
  return `hsl(${Math.round(120 * p)} ${p > 0.9 ? 45 : 85}% ${72 + 20 * p}%)`;
}

function tokenView(d) {
  const box = el("div", { class: "tokens", "data-testid": "tokens", "data-count": d.token_ids.length });
  const starts = new Map(d.turns.filter((t) => t.index > 0).map((t) => [t.observation_start, t.index]));
  const fork = d.session && d.session.branch > 0 ? d.session.fork_common_tokens : null;
  const parts = [];
  for (let i = 0; i < d.token_ids.length; i++) {
    if (starts.has(i)) {
      parts.push(el("span", { class: "mark turn", "data-testid": "turn-boundary", text: `turn ${starts.get(i)}` }));
    }
    if (i > 0 && d.policy_versions[i] !== d.policy_versions[i - 1]) {
      parts.push(el("span", { class: "mark version", "data-testid": "version-boundary", text: `v${d.policy_versions[i]}` }));
    }
    if (fork !== null && i === fork) parts.push(el("span", { class: "mark fork", "data-testid": "fork-point", text: "fork" }));
    const lp = d.logprobs[i];
    const span = el("span", {
      class: "tok", "data-testid": "token", "data-i": i, "data-id": d.token_ids[i], "data-origin": d.origins[i],
      "data-mask": d.loss_mask[i], "data-lp": lp === null ? "" : String(lp), "data-version": d.policy_versions[i],
      title: `#${i} id ${d.token_ids[i]} · ${d.origins[i]} · mask ${d.loss_mask[i]} · ` +
        `logprob ${lp === null ? "—" : lp.toFixed(4)} · v${d.policy_versions[i]}`,
      text: d.token_text[i],
    });
    if (lp !== null) span.style.background = heat(lp);
    parts.push(span);
  }
  box.append(...parts);
  return box;
}

function turnsTable(d) {
  const rows = d.turns.map((t) =>
    el("tr", { "data-testid": "turn-row" },
      el("td", { text: t.index }), el("td", { text: t.replica ?? "" }), el("td", { text: t.latency_ms.toFixed(1) }),
      el("td", { text: t.ttft_ms.toFixed(1) }), el("td", { text: t.end - t.observation_start }),
      el("td", { text: t.usage.cached_tokens }), el("td", { text: t.usage.generated_tokens }),
      el("td", { text: t.finish_reason ?? "running" }), el("td", { text: `v${t.policy_version}` })),
  );
  return el("table", {},
    el("thead", {}, el("tr", {}, ...["turn", "replica", "latency ms", "ttft ms", "new tokens", "cached", "generated",
      "finish", "version"].map((h) => el("th", { text: h })))),
    el("tbody", {}, ...rows));
}

function legend() {
  return el("div", { class: "legend" },
    ...ORIGINS.slice(0, 4).map((o) => el("span", {}, el("span", { class: `sw ${o}` }), ` ${o}`)),
    el("span", { text: "underlined: in the loss mask" }),
    el("span", {}, "logprob ", el("span", { class: "heat", title: "p = 0 … 1" }), " (value on hover)"));
}

function download(d) {
  const blob = new Blob([JSON.stringify(d, null, 1)], { type: "application/json" });
  return el("a", { href: URL.createObjectURL(blob), download: `${d.episode_id}.json`, "data-testid": "download",
    text: "Download JSON" });
}

function branches(d) {
  if (!d.session) return null;
  const s = d.session;
  return el("div", { class: "branches", "data-testid": "branches", "data-count": s.branches.length },
    el("span", { text: `session ${s.id}: branch ${s.branch}` + (s.fork_common_tokens !== null && s.branch > 0
      ? `, forked after ${s.fork_common_tokens} tokens in common · ` : " · ") }),
    ...s.branches.map((b) => el("button", {
      type: "button", "data-testid": "branch", "data-id": b.id, "data-branch": b.branch,
      class: b.id === d.episode_id ? "current" : "", onclick: () => select(b.id),
      text: `branch ${b.branch} (${b.status}, ${b.tokens} tokens)`,
    })));
}

async function groupView(d) {
  if (d.group.length < 2) return null;
  const members = await Promise.all(d.group.map((m) => api(`/v1/inspect/episodes/${m.id}`).catch(() => null)));
  return el("div", { class: "group", "data-testid": "group", "data-count": d.group.length },
    ...members.filter(Boolean).map((m) => el("div", { class: "member", "data-testid": "group-member", "data-id": m.episode_id },
      el("h3", { onclick: () => select(m.episode_id),
        text: `#${m.group_index} ${short(m.episode_id)} · ${m.summary.status}` +
          (m.rewards.length ? ` · reward ${m.rewards.join(", ")}` : "") }),
      tokenView(m))));
}

async function loadDetail() {
  const box = $("[data-testid=detail]");
  if (!state.selected) return void (box.hidden = true);
  let d;
  try {
    d = await api(`/v1/inspect/episodes/${state.selected}`);
  } catch (err) {
    box.replaceChildren(el("p", { "data-testid": "detail-message", text: explain(err) }));
    return void (box.hidden = false);
  }
  if (d.episode_id !== state.selected) return; // another one was selected meanwhile
  const s = d.summary;
  box.dataset.id = d.episode_id;
  box.dataset.status = s.status;
  const group = await groupView(d);
  if (state.selected !== d.episode_id) return;
  box.replaceChildren(...[
    el("h2", { text: `Episode ${d.episode_id}` }),
    el("div", { class: "meta" },
      el("span", { text: `status ${s.status}` }), el("span", { text: `tenant ${d.tenant || "—"}` }),
      el("span", { text: `model ${d.model}` }), el("span", { text: `group ${d.group_id} #${d.group_index}` }),
      el("span", { text: `${d.token_ids.length} tokens, ${s.sampled_tokens} sampled` }),
      el("span", { text: s.request_ids.length ? `requests ${s.request_ids.join(", ")}` : "" }),
      el("span", { text: d.rewards.length ? `rewards ${d.rewards.join(", ")}` : "" })),
    el("div", { class: "actions" }, download(d)),
    branches(d),
    turnsTable(d),
    legend(),
    tokenView(d),
    group,
  ].filter(Boolean));
  box.hidden = false;
}

// -- fleet ----------------------------------------------------------------------------------------------------

function card(label, value, testid) {
  return el("div", { class: "card", "data-testid": testid }, el("b", { text: value }), label);
}

async function loadFleet() {
  const box = $("[data-testid=fleet-view]");
  let f;
  try {
    f = await api("/v1/inspect/fleet");
  } catch (err) {
    const text = err.status === 403
      ? `The fleet view needs an admin tenant (auth.admin_tenants); this token's tenant is not one. ${err.message}`
      : explain(err);
    return box.replaceChildren(el("p", { class: "bad", "data-testid": "fleet-message", text }));
  }
  const u = f.last_weight_update;
  const update = u
    ? `v${u.previous_version} → v${u.version} at ${when(u.at)}: loaded in ${u.duration_ms.toFixed(0)} ms` +
      (u.paused_ms !== null ? `, the bridge paused ${u.paused_ms.toFixed(0)} ms` : u.in_pause ? ", paused now" : ", no pause")
    : "none since the bridge started";
  const pct = (c) => (c.hit_rate === null ? "—" : `${(100 * c.hit_rate).toFixed(1)} %`);
  box.replaceChildren(el("div", { class: "fleet" },
    el("div", { class: "cards" },
      card("policy version", `v${f.policy_version}`, "fleet-version"),
      card("fleet version", f.fleet_version === null ? "— (no fleet)" : `v${f.fleet_version}`, "fleet-registry-version"),
      card("state", f.paused ? "paused" : "serving", "fleet-paused"),
      card("Steps in flight", f.inflight_steps, "fleet-inflight"),
      card("open episodes", f.open_episodes, "fleet-open")),
    el("p", { "data-testid": "last-update", text: `Last weight update: ${update}` }),
    el("h2", { text: "Bridges" }),
    el("table", {}, el("thead", {}, el("tr", {}, ...["id", "address", "models", "Steps in flight", "seen"].map((h) => el("th", { text: h })))),
      el("tbody", {}, ...f.bridges.map((b) => el("tr", { "data-testid": "bridge-row" },
        el("td", { text: b.id }), el("td", { class: "mono", text: b.address }), el("td", { text: b.models.join(", ") }),
        el("td", { text: b.load }), el("td", { text: when(b.seen) }))))),
    el("h2", { text: `Replicas of ${f.model} (${f.engine})` }),
    el("table", {}, el("thead", {}, el("tr", {}, ...["replica", "health", "state", "in-flight tokens", "version",
      "turns", "cache hit rate"].map((h) => el("th", { text: h })))),
      el("tbody", {}, ...f.replicas.map((r) => el("tr", {
        "data-testid": "replica-row", "data-state": r.state, "data-healthy": r.healthy, "data-version": r.policy_version },
        el("td", { class: "mono", text: r.name }),
        el("td", { class: r.healthy ? "good" : "bad", text: r.healthy ? "healthy" : "out of rotation" }),
        el("td", { text: r.state }), el("td", { text: r.load_tokens }), el("td", { text: `v${r.policy_version}` }),
        el("td", { text: r.cache.turns }), el("td", { "data-testid": "hit-rate", text: pct(r.cache) }))))),
  ));
}

function show(tab) {
  state.tab = tab;
  for (const b of document.querySelectorAll("nav button")) b.classList.toggle("active", b.dataset.tab === tab);
  $("[data-testid=episodes-view]").hidden = tab !== "episodes";
  $("[data-testid=fleet-view]").hidden = tab !== "fleet";
  if (tab === "fleet") loadFleet();
}

// -- live -----------------------------------------------------------------------------------------------------

function setConn(s) {
  const c = $("[data-testid=conn]");
  c.dataset.state = s;
  c.textContent = s;
}

function refreshSoon(id) {
  if (id) state.changed.add(id);
  if (state.pending) return; // coalesce a burst of events into one refresh
  state.pending = setTimeout(async () => {
    const changed = state.changed;
    state.pending = null;
    state.changed = new Set();
    await loadEpisodes().catch((err) => say(explain(err)));
    if (state.selected && (changed.has(state.selected) || changed.has("*"))) await loadDetail();
    if (state.tab === "fleet") await loadFleet();
  }, 150);
}

function onEvent(kind, data) {
  if (kind === "hello") {
    const restarted = state.boot && state.boot !== data.boot;
    state.boot = data.boot;
    if (restarted || data.reset) refreshSoon("*");
  } else if (kind === "lagged") {
    refreshSoon("*");
  } else {
    refreshSoon(data.id || "*");
  }
}

function onBlock(block) {
  let kind = "message";
  const data = [];
  for (const line of block.split("\n")) {
    if (line.startsWith(":")) continue;
    const at = line.indexOf(":");
    const field = at < 0 ? line : line.slice(0, at);
    const value = at < 0 ? "" : line.slice(at + 1).replace(/^ /, "");
    if (field === "retry" && /^\d+$/.test(value)) state.retryMs = Number(value);
    else if (field === "id") state.lastEventId = value;
    else if (field === "event") kind = value;
    else if (field === "data") data.push(value);
  }
  if (data.length) onEvent(kind, JSON.parse(data.join("\n")));
}

async function follow() {
  state.streaming = true;
  for (;;) {
    try {
      const headers = { Accept: "text/event-stream" };
      if (state.token) headers.Authorization = `Bearer ${state.token}`;
      if (state.lastEventId) headers["Last-Event-ID"] = state.lastEventId;
      const response = await fetch("/v1/inspect/events", { headers, cache: "no-store" });
      if (response.status === 401 || response.status === 403) {
        state.streaming = false;
        setConn("stopped");
        return askToken(explain(new ApiError(response.status, "the live stream was refused")));
      }
      if (response.ok) {
        setConn("live");
        say("");
        const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
        let buffer = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buffer += value.replace(/\r\n?/g, "\n");
          let end;
          while ((end = buffer.indexOf("\n\n")) >= 0) {
            onBlock(buffer.slice(0, end));
            buffer = buffer.slice(end + 2);
          }
        }
      }
    } catch {
      // the bridge went away (restart, network): reconnect below
    }
    setConn("reconnecting");
    await new Promise((r) => setTimeout(r, state.retryMs));
  }
}

// -- wiring ---------------------------------------------------------------------------------------------------

$("[data-testid=token-form]").addEventListener("submit", (ev) => {
  ev.preventDefault();
  setToken($("[data-testid=token-input]").value.trim());
  start();
});
$("[data-testid=change-token]").addEventListener("click", () => {
  setToken("");
  askToken("Enter another tenant's token.");
});
$("[data-testid=filters]").addEventListener("submit", (ev) => {
  ev.preventDefault();
  loadEpisodes().catch((err) => say(explain(err)));
});
for (const b of document.querySelectorAll("nav button")) b.addEventListener("click", () => show(b.dataset.tab));
start();
