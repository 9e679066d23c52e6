#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Stands in for `vllm`, `lm_eval` and `vllm-flydsl-indexer` on the example scripts' PATH.

tests/test_examples.py copies this file into a PATH directory once per program name
(with its own interpreter in the ``#!`` line); the name it was started as picks the
behaviour. Every call appends its argv and VLLM_* environment to $FAKE_RECORD. The
fake server answers /health on loopback and prints the plugin's per-process lines.
"""

import http.server
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# The plugin's own names: the scripts must set the variables the plugin reads, and grep
# the heads of the lines it logs.
from vllm_flydsl_indexer import envs
from vllm_flydsl_indexer.envs import TABLE_IGNORED_LINE

name = Path(sys.argv[0]).name
argv = sys.argv[1:]
samples = Path(os.environ["FAKE_SAMPLES"])


def record(**extra):
    env = {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}
    with open(os.environ["FAKE_RECORD"], "a") as f:
        f.write(json.dumps({"prog": name, "argv": argv, "env": env, "pid": os.getpid(), **extra}) + "\n")


def opt(flag):
    return argv[argv.index(flag) + 1]


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def serve():
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    record(worker=worker.pid)
    on = os.environ.get(envs.SWITCH) == "1"
    n_active = int(os.environ.get("FAKE_ACTIVE", "10")) if on else 0
    for i in range(10):
        line = os.environ["FAKE_ACTIVE_LINE"] if i < n_active else os.environ["FAKE_STOCK_LINE"]
        print(f"(Worker_TP{i} pid={os.getpid()}) INFO [__init__.py:80] {line}", flush=True)
    if on and os.environ.get("FAKE_TABLE_IGNORED") and os.environ.get(envs.TUNED_CSV):
        ignored = f"{TABLE_IGNORED_LINE} no rows for this GPU's 304 CUs"
        print(f"(Worker_TP0) WARNING {ignored}", flush=True)
    time.sleep(float(os.environ.get("FAKE_HEALTH_DELAY", "1.5")))
    http.server.HTTPServer((opt("--host"), int(opt("--port"))), Health).serve_forever()


def bench():
    record()
    meta = dict(
        kv.split("=", 1)
        for kv in argv[argv.index("--metadata") + 1 :]
        if "=" in kv and not kv.startswith("--")
    )
    recorded = samples / "sample_bench" / meta["arm"] / f"c{opt('--max-concurrency')}.json"
    data = json.loads(recorded.read_text())
    out = Path(opt("--result-dir"))
    out.mkdir(parents=True, exist_ok=True)
    (out / opt("--result-filename")).write_text(json.dumps(data))


def lm_eval():
    record()
    if os.environ.get("FAKE_LM_EVAL_RC"):
        sys.exit(int(os.environ["FAKE_LM_EVAL_RC"]))
    out = Path(opt("--output_path"))
    arm = "flydsl" if "/flydsl/" in f"{out}/" else "stock"
    data = json.loads((samples / f"sample_{arm}.json").read_text())
    tasks = opt("--tasks").split(",")
    data["results"] = {t: v for t, v in data["results"].items() if t in tasks}
    stamp = time.strftime("%Y-%m-%dT%H-%M-%S") + f".{time.time_ns() % 10**9:09d}"
    target = out / "deepseek-ai__DeepSeek-V3.2-Exp" / f"results_{stamp}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(data))


def tune():
    # What `tune --out` writes on a node: aiter-format rows for its GPU.
    record()
    from vllm_flydsl_indexer import tuning

    if os.environ.get("FAKE_TUNE_RC"):
        sys.exit(int(os.environ["FAKE_TUNE_RC"]))
    gfx = os.environ.get("FAKE_TUNE_GFX", "gfx950")
    with open(opt("--out"), "w") as f:
        f.write(",".join(tuning.COLUMNS) + "\n")
        for batch, backend in ((1, "gluon"), (64, "flydsl")):
            f.write(f"{gfx},256,{batch},1,32,128,64,1,8192,{backend},256,2,2,10.0,10.0,9.0\n")
    print(f"tune --out: wrote 2 rows (kernel timings) to {opt('--out')}, kept 0 earlier rows")


def doctor():
    # The real plugin's table parser, as `doctor` runs it on a gfx950 node.
    record()
    if "--json" not in argv:
        print("fake doctor report")
        sys.exit(int(os.environ.get("FAKE_DOCTOR_RC", "0")))
    from vllm_flydsl_indexer import tuning

    source = os.environ.get(envs.TUNED_CSV)
    table = tuning.read(source, "gfx950", source)  # the plugin's own lenient reader: never raises
    if isinstance(table, str):
        report = {"source": source, "note": f"IGNORED: {table}"}
    else:
        rows = sum(len(rows) for buckets in table.shapes.values() for rows in buckets.values())
        report = {"source": source, "gfx": table.gfx, "rows": rows, "note": "in use"}
    print(json.dumps({"tuned_table": report}))


if name == "vllm" and argv[:1] == ["serve"]:
    serve()
elif name == "vllm" and argv[:2] == ["bench", "serve"]:
    bench()
elif name == "lm_eval":
    lm_eval()
elif name == "vllm-flydsl-indexer" and argv[:2] == ["tune", "--out"]:
    tune()
elif name == "vllm-flydsl-indexer" and argv[:1] == ["doctor"]:
    doctor()
else:
    sys.exit(f"fake {name}: unexpected arguments {argv}")
