// Runs the dashboard's app.js in node with a minimal DOM and a fetch that serves recorded API answers, then
// prints what loadCharts drew: per chart its metric, dots and interval bars (tests/service/dashboard/test_dashboard_intervals.py).
// Usage: node dashboard_charts.js app.js answers.json [job.json]   (answers: {url: json}; a URL not in it is printed
// and fails; job: the job object the page shows, by default a cispo job with id "job")
"use strict";
const fs = require("fs");
const vm = require("vm");

class FakeNode {
  constructor(tag) { this.tag = tag; this.attrs = {}; this.children = []; this.textContent = ""; }
  setAttribute(name, value) { this.attrs[name] = String(value); }
  append(...children) { this.children.push(...children); }
  replaceChildren(...children) { this.children = children; }
  addEventListener() {}
  querySelector() { return new FakeNode("query"); }
}
const byId = {};
const answers = JSON.parse(fs.readFileSync(process.argv[3], "utf8"));
const asked = [];
const context = {
  Node: FakeNode, console, location: { hash: "" },
  localStorage: { getItem: () => "key", setItem() {}, removeItem() {} },
  document: {
    createElement: (tag) => new FakeNode(tag), createElementNS: (ns, tag) => new FakeNode(tag),
    getElementById: (id) => (byId[id] ||= new FakeNode(id)), addEventListener() {},
  },
  fetch: async (url) => {
    asked.push(url);
    if (!(url in answers)) return { ok: false, status: 599, statusText: "not recorded", json: async () => ({}) };
    return { ok: true, status: 200, json: async () => answers[url] };
  },
};
vm.createContext(context);
vm.runInContext(fs.readFileSync(process.argv[2], "utf8"), context);

function walk(node, out) {
  if (!(node instanceof FakeNode)) return out;
  out.push(node);
  for (const child of node.children) walk(child, out);
  return out;
}

const job = process.argv[4] ? fs.readFileSync(process.argv[4], "utf8") : '{"id": "job", "method": {"type": "cispo"}}';
vm.runInContext(`loadCharts(${job})`, context).then(() => {
  const charts = byId.charts.children.map((figure) => {
    const nodes = walk(figure, []);
    return {
      metric: figure.attrs["data-metric"],
      dots: nodes.filter((n) => n.tag === "circle").map((n) => ({ cx: +n.attrs.cx, cy: +n.attrs.cy })),
      intervals: nodes.filter((n) => n.attrs.class === "interval").map((n) => ({
        step: +n.attrs["data-step"], x: +n.attrs.x1, y_low: +n.attrs.y1, y_high: +n.attrs.y2 })),
      ticks: nodes.filter((n) => n.attrs.class === "tick" && n.attrs["text-anchor"] === "end" && n.attrs.x !== undefined
        && !String(n.children[0]).startsWith("step")).map((n) => ({ x: +n.attrs.x, text: String(n.children[0]) })),
    };
  });
  console.log(JSON.stringify({ asked, charts }));
}, (error) => { console.log(JSON.stringify({ asked, error: String(error) })); process.exit(1); });
