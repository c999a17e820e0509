"""Run the widget's frontend in a plain browser page, without Jupyter, for development.

    python js/dev/harness.py [--port 8765] [--model llama-3.2-1b] [--dark]

Serves (on 127.0.0.1 only) a page that loads vramwidget/static/widget.js and
widget.css with a small stand-in for the anywidget model. Every `save_changes()` from
the page is POSTed here and applied with `Calculator.set_state` (what the Jupyter comm
does), and the traits Python changed in response are sent back as change events. So
the page behaves as in a notebook: Python computes, the page draws.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

STATIC = ROOT / "vramwidget" / "static"

PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>vramwidget harness</title>
<link rel="stylesheet" href="/widget.css">
<style>
  body { margin: 16px; font: 13px system-ui, sans-serif; }
  body.dark { background: #111; color: #ddd;
    --jp-ui-font-color1: rgba(255,255,255,0.87); --jp-ui-font-color2: rgba(255,255,255,0.54);
    --jp-layout-color1: #111; --jp-border-color1: #616161; --jp-border-color2: #424242;
    --jp-input-background: #212121; --jp-error-color1: #e57373; }
</style></head>
<body class="%(body_class)s"><div id="root"></div>
<script type="module">
import widget from "/widget.js";
class Model {
  constructor(state) { this.state = state; this.handlers = new Map(); this.pending = {}; this.sent = []; }
  get(k) { return this.state[k]; }
  set(k, v) { this.state[k] = v; this.pending[k] = v; this.emit("change:" + k); }
  on(ev, cb) { if (!this.handlers.has(ev)) this.handlers.set(ev, new Set()); this.handlers.get(ev).add(cb); }
  off(ev, cb) { if (ev && cb) this.handlers.get(ev)?.delete(cb); else if (ev) this.handlers.delete(ev); else this.handlers.clear(); }
  emit(ev) { for (const cb of this.handlers.get(ev) || []) cb(); }
  async save_changes() {
    const changes = this.pending; this.pending = {}; this.sent.push(changes);
    const res = await fetch("/set", { method: "POST", body: JSON.stringify(changes) });
    const update = await res.json();
    for (const [k, v] of Object.entries(update)) { this.state[k] = v; this.emit("change:" + k); }
    window.__updates = (window.__updates || 0) + 1;
  }
}
const state = await (await fetch("/state")).json();
const model = new Model(state);
window.__model = model;
await widget.initialize?.({ model });
window.__cleanup = await widget.render({ model, el: document.getElementById("root") });
window.__ready = true;
</script></body></html>
"""


def make_handler(calc, body_class: str):
    def state():
        return json.loads(json.dumps(calc.get_state(), default=str))

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def _send(self, body: bytes, ctype: str, code: int = 200):
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path in ("/", "/index.html"):
                self._send((PAGE % {"body_class": body_class}).encode(), "text/html; charset=utf-8")
            elif self.path == "/widget.js":
                self._send((STATIC / "widget.js").read_bytes(), "text/javascript; charset=utf-8")
            elif self.path == "/widget.css":
                self._send((STATIC / "widget.css").read_bytes(), "text/css; charset=utf-8")
            elif self.path == "/state":
                self._send(json.dumps(state()).encode(), "application/json")
            else:
                self._send(b"not found", "text/plain", 404)

        def do_POST(self):
            if self.path != "/set":
                return self._send(b"not found", "text/plain", 404)
            changes = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            before = state()
            calc.set_state(changes)
            after = state()
            update = {k: v for k, v in after.items() if before.get(k) != v or k in changes and v != changes[k]}
            self._send(json.dumps(update).encode(), "application/json")

    return Handler


def serve(calc, port: int = 8765, dark: bool = False) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", port), make_handler(calc, "dark" if dark else ""))
    return server


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--dark", action="store_true")
    args = ap.parse_args()
    from vramwidget.widget import Calculator

    server = serve(Calculator(args.model), args.port, args.dark)
    print(f"http://127.0.0.1:{args.port}/")
    server.serve_forever()


if __name__ == "__main__":
    main()
