// orchestrator view: sortable tables, expand/collapse, and live updates of a running run.
// Loaded from the package (no CDN); the page's Content-Security-Policy allows no inline
// script, so everything the page does is here. It never builds HTML from agent output: the
// live update swaps in the server's rendered (escaped) fragment.
"use strict";

function sortTable(table, column, header) {
  const body = table.tBodies[0];
  const numeric = header.dataset.type === "number";
  const ascending = header.dataset.order !== "asc";
  for (const th of table.tHead.rows[0].cells) delete th.dataset.order;
  header.dataset.order = ascending ? "asc" : "desc";
  const key = (row) => {
    const cell = row.cells[column];
    const raw = cell ? (cell.dataset.sort !== undefined ? cell.dataset.sort : cell.textContent) : "";
    return numeric ? parseFloat(raw) || 0 : raw.trim().toLowerCase();
  };
  const rows = Array.from(body.rows);
  rows.sort((a, b) => {
    const x = key(a), y = key(b);
    return (x < y ? -1 : x > y ? 1 : 0) * (ascending ? 1 : -1);
  });
  for (const row of rows) body.appendChild(row);
}

function setupTables(root) {
  for (const table of root.querySelectorAll("table.sortable")) {
    if (!table.tHead) continue;
    Array.from(table.tHead.rows[0].cells).forEach((th, column) => {
      th.classList.add("sort");
      th.addEventListener("click", () => sortTable(table, column, th));
    });
  }
}

function setupButtons(root) {
  for (const button of root.querySelectorAll("button.expand-all, button.collapse-all")) {
    button.addEventListener("click", () => {
      const open = button.classList.contains("expand-all");
      for (const d of document.querySelectorAll("#tree details")) d.open = open;
    });
  }
}

function follow(container) {
  const url = container.dataset.liveUrl;
  const tick = async () => {
    let data;
    try {
      const response = await fetch(url, { credentials: "same-origin", cache: "no-store" });
      if (!response.ok) throw new Error(String(response.status));
      data = await response.json();
    } catch (error) {
      setTimeout(tick, 3000);
      return;
    }
    const open = {};
    for (const d of container.querySelectorAll("details[data-key]")) open[d.dataset.key] = d.open;
    container.innerHTML = data.html;
    for (const d of container.querySelectorAll("details[data-key]")) {
      if (d.dataset.key in open) d.open = open[d.dataset.key];
    }
    setupButtons(container);
    if (data.ended) {
      delete container.dataset.liveUrl;
      document.body.dataset.runEnded = "1";
    } else {
      setTimeout(tick, 1000);
    }
  };
  setTimeout(tick, 1000);
}

document.addEventListener("DOMContentLoaded", () => {
  setupTables(document);
  setupButtons(document);
  const live = document.querySelector("#run-body[data-live-url]");
  if (live) follow(live);
  document.body.dataset.ready = "1";
});
