// loramux console: the upload progress bar, charts and the live engine page. Pages work without it,
// except what needs a script by nature (progress, charts, live refresh).
(function () {
  "use strict";
  const csrf = document.querySelector('meta[name="csrf-token"]')?.content || "";

  // --- adapter upload with progress ------------------------------------------------------------
  const upload = document.getElementById("upload-form");
  if (upload) {
    upload.addEventListener("submit", function (event) {
      event.preventDefault();
      const bar = document.getElementById("upload-progress");
      const status = document.getElementById("upload-status");
      const xhr = new XMLHttpRequest();
      xhr.open("POST", upload.action);
      xhr.setRequestHeader("X-CSRF-Token", csrf);
      bar.hidden = false; bar.value = 0;
      status.className = ""; status.textContent = "Uploading…";
      xhr.upload.addEventListener("progress", function (e) {
        if (e.lengthComputable) { bar.value = Math.round((100 * e.loaded) / e.total); }
      });
      xhr.addEventListener("load", function () {
        let answer = {};
        try { answer = JSON.parse(xhr.responseText); } catch (err) { answer = {message: xhr.statusText}; }
        if (xhr.status === 201 && answer.ok) {
          bar.value = 100;
          status.className = "notice";
          status.textContent = "Validated and stored: " + answer.adapter.name + " version " +
            answer.adapter.version + ". Reloading…";
          window.location.assign("/console/adapters?notice=uploaded");
        } else {
          status.className = "error";
          status.textContent = "Refused (" + xhr.status + "): " + (answer.message || "unknown error");
          bar.hidden = true;
        }
      });
      xhr.addEventListener("error", function () {
        status.className = "error"; status.textContent = "The upload failed: the server could not be reached.";
      });
      xhr.send(new FormData(upload));
    });
  }

  // --- charts --------------------------------------------------------------------------------------
  function bars(canvasId, labels, values, label) {
    const canvas = document.getElementById(canvasId);
    if (!canvas || typeof Chart === "undefined") { return null; }
    return new Chart(canvas, {type: "bar", data: {labels: labels, datasets: [{label: label, data: values}]},
                              options: {responsive: true, maintainAspectRatio: false, animation: false}});
  }
  const usage = document.getElementById("usage-data");
  if (usage) {
    const data = JSON.parse(usage.textContent);
    bars("spend-by-tenant", data.tenants.map(t => t.label), data.tenants.map(t => t.cost), "spend (USD)");
    bars("tokens-by-tenant", data.tenants.map(t => t.label), data.tenants.map(t => t.tokens), "tokens");
    bars("spend-by-adapter", data.adapters.map(a => a.label), data.adapters.map(a => a.cost), "spend (USD)");
    bars("tokens-by-adapter", data.adapters.map(a => a.label), data.adapters.map(a => a.tokens), "tokens");
  }

  // Money comes as exact decimal strings; numbers only to draw them (null: a day still to come).
  const amount = v => (v === null ? null : Number(v));
  const color = name => getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  const tint = (hex, alpha) => "rgba(" + [1, 3, 5].map(i => parseInt(hex.slice(i, i + 2), 16)).join(", ") +
    ", " + alpha + ")";
  const budget = document.getElementById("budget-data");
  const budgetCanvas = document.getElementById("budget-chart");
  if (budget && budgetCanvas && typeof Chart !== "undefined") {
    const d = JSON.parse(budget.textContent);
    const datasets = [
      {type: "bar", label: "daily spend (USD)", data: d.daily.map(amount), order: 3,
       backgroundColor: tint(color("--accent"), 0.3), borderColor: color("--accent")},
      {type: "line", label: "cumulative spend (USD)", data: d.cumulative.map(amount), order: 1,
       borderColor: color("--accent"), backgroundColor: color("--accent"), pointRadius: 2}];
    if (d.limit !== null) {
      datasets.push({type: "line", label: "limit (USD)", data: d.labels.map(() => Number(d.limit)), order: 2,
                     borderColor: color("--bad"), backgroundColor: color("--bad"), borderDash: [6, 4],
                     pointRadius: 0});
    }
    new Chart(budgetCanvas, {type: "bar", data: {labels: d.labels, datasets: datasets},
                             options: {responsive: true, maintainAspectRatio: false, animation: false,
                                       scales: {y: {beginAtZero: true}},
                                       // the lines are drawn over the bars (order), the legend keeps this order
                                       plugins: {legend: {labels: {sort: (a, b) => a.datasetIndex - b.datasetIndex}}}}});
  }
  const tags = document.getElementById("tag-spend-data");
  const tagCanvas = document.getElementById("spend-by-tag");
  if (tags && tagCanvas && typeof Chart !== "undefined") {
    const d = JSON.parse(tags.textContent);
    new Chart(tagCanvas, {type: "bar",
      data: {labels: d.labels, datasets: d.tags.map(t => ({label: t.tag, data: t.daily.map(amount)}))},
      options: {responsive: true, maintainAspectRatio: false, animation: false,
                scales: {x: {stacked: true}, y: {stacked: true, beginAtZero: true}}}});
  }

  // --- the live engine page ------------------------------------------------------------------------
  const engine = document.getElementById("engine-live");
  if (engine) {
    let latency = null;
    const set = (id, text) => { const el = document.getElementById(id); if (el) { el.textContent = text; } };
    async function refresh() {
      try {
        const answer = await fetch("/console/engine/data", {headers: {"Accept": "application/json"}});
        if (answer.status === 401) { window.location.assign("/console/login"); return; }
        const d = await answer.json();
        set("running", d.running ?? "–");
        set("waiting", d.waiting ?? "–");
        set("kv", d.kv_blocks_total ? Math.round((100 * d.kv_blocks_used) / d.kv_blocks_total) + " %" : "–");
        set("slots", (d.device_adapters ?? "–") + (d.adapter_slots_pinned != null ? " (" + d.adapter_slots_pinned + " pinned)" : ""));
        set("updated", new Date().toLocaleTimeString());
        const labels = d.latency.map(m => m.minute);
        if (typeof Chart !== "undefined") {
          if (!latency) {
            latency = new Chart(document.getElementById("latency-chart"), {type: "line",
              data: {labels: labels, datasets: [{label: "TTFT (ms)", data: []}, {label: "inter-token (ms)", data: []}]},
              options: {responsive: true, maintainAspectRatio: false, animation: false, spanGaps: true}});
          }
          latency.data.labels = labels;
          latency.data.datasets[0].data = d.latency.map(m => m.ttft_ms);
          latency.data.datasets[1].data = d.latency.map(m => m.itl_ms);
          latency.update();
        }
        const empty = document.getElementById("latency-empty");
        if (empty) { empty.hidden = d.latency.length > 0; }
      } catch (err) {
        set("updated", "not updated: " + err);
      }
    }
    refresh();
    setInterval(refresh, 2000);
  }
})();
