"""Throughput: requests per second one host proxies, kvgate beside SMG and the engines alone.

Two zero-engine-time engines (one nginx process answering a canned vLLM
completion, /health, /v1/models and /metrics on two ports) stand in for vLLM,
so the proxies are what is measured. ``wrk`` (one thread, 16 connections,
keep-alive, a short non-streaming completion) drives, in turn and repeated
(interleaved, so a change in the machine's load hits every target alike):

* ``engine``: straight to one engine (the ceiling of the load generator+engine);
* ``kvgate``: ``kvgate serve`` (default policy), one process;
* ``kvgate --workers N``: N processes on one port (SO_REUSEPORT);
* ``smg``: SMG (``smg launch``, policy cache_aware), when its binary is given.

Prints the median, min and max req/s per target over the rounds, wrk's p50/p99
latency, the proxy's CPU time per request (all its processes, from /proc: less
sensitive to a shared machine's load than req/s), the ratio kvgate/SMG per
round (target: >= 0.5), and the load average before and after. Needs ``wrk``
and ``nginx`` (Debian packages) and, for the SMG row, SMG in a virtualenv of
its own (``pip install smg``), never in the repository's.

    python benchmarks/bench_throughput.py [--seconds 8] [--rounds 3] [--workers 2]
        [--smg /work/team/smg-venv/bin/smg]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from gateway.cli.demo import free_port  # noqa: E402

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


@dataclass
class Target:
    name: str
    url: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    rps: list[float] = field(default_factory=list)
    p50: list[float] = field(default_factory=list)
    p99: list[float] = field(default_factory=list)
    cpu_us: list[float] = field(default_factory=list)
    failed: int = 0

    def pids(self) -> list[int]:
        """The target's processes and their children (kvgate's workers)."""
        roots = {p.pid for p in self.procs}
        out = set(roots)
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, ValueError):
                    continue
                if ppid in roots:
                    out.add(int(entry.name))
        return sorted(out)


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def wait_ready(url: str, path: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}")
        try:
            if httpx.get(url + path, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url}{path} not ready after {timeout} s")


def spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as fh:
        return subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT)


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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=8.0, help="per wrk run (default 8)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--workers", type=int, default=2, help="kvgate --workers N row (default 2)")
    ap.add_argument("--smg", default="/work/team/smg-venv/bin/smg", help="SMG's binary")
    args = ap.parse_args()
    for tool in ("wrk", "nginx"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            print(f"{tool} is needed: apt-get install -y {tool}", file=sys.stderr)
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
    try:
        targets.append(Target("engine (nginx) alone", engines[0]))
        py = [sys.executable, "-m", "gateway.cli", "serve", "--log-level", "warning"]
        for workers in (1, args.workers):
            port = free_port()
            cmd = [*py, "--port", str(port), "--workers", str(workers)]
            for e in engines:
                cmd += ["--engine", e]
            name = "kvgate" if workers == 1 else f"kvgate --workers {workers}"
            t = Target(name, f"http://127.0.0.1:{port}")
            t.procs.append(spawn(cmd, workdir / f"kvgate-{workers}.log"))
            wait_ready(t.url, "/ready", t.procs[0])
            targets.append(t)
        if Path(args.smg).exists():
            port = free_port()
            cmd = [args.smg, "launch", "--host", "127.0.0.1", "--port", str(port)]
            cmd += ["--worker-urls", *engines, "--policy", "cache_aware", "--log-level", "warn"]
            cmd += ["--prometheus-port", str(free_port())]
            t = Target("smg", f"http://127.0.0.1:{port}")
            t.procs.append(spawn(cmd, workdir / "smg.log"))
            wait_ready(t.url, "/health", t.procs[0])
            targets.append(t)
        else:
            print(f"no SMG at {args.smg}: its row is left out", file=sys.stderr)
        for t in targets:  # warm-up: connections, caches
            run_wrk(t.url + "/v1/completions", 2, script)
        load_before = os.getloadavg()
        for _ in range(args.rounds):
            for t in targets:
                pids = t.pids()
                cpu0 = cpu_seconds(pids)
                rps, p50, p99, bad = run_wrk(t.url + "/v1/completions", args.seconds, script)
                if pids:
                    t.cpu_us.append((cpu_seconds(pids) - cpu0) / (rps * args.seconds) * 1e6)
                t.rps.append(rps)
                t.p50.append(p50)
                t.p99.append(p99)
                t.failed += bad
        load_after = os.getloadavg()
    finally:
        for t in targets:
            for p in t.procs:
                p.terminate()
        for t in targets:
            for p in t.procs:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
        stop = [nginx, "-c", str(workdir / "nginx.conf"), "-p", str(workdir), "-s", "stop"]
        subprocess.run(stop, check=False, capture_output=True)
    print(
        f"wrk -t1 -c16, {args.seconds:g} s x {args.rounds} interleaved rounds, 2 nginx engines, "
        f"{os.cpu_count()} cores; load average {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} after"
    )
    print(
        f"{'target':<24} {'req/s median':>12} {'min':>8} {'max':>8} {'p50 ms':>7} {'p99 ms':>7}"
        f" {'CPU us/req':>10}"
    )
    for t in targets:
        print(
            f"{t.name:<24} {statistics.median(t.rps):12,.0f} {min(t.rps):8,.0f} "
            f"{max(t.rps):8,.0f} {statistics.median(t.p50):7.2f} {statistics.median(t.p99):7.2f}"
            + (f" {statistics.median(t.cpu_us):10.0f}" if t.cpu_us else f" {'-':>10}")
            + (f"  ({t.failed} failed)" if t.failed else "")
        )
    by_name = {t.name: t for t in targets}
    smg = by_name.get("smg")
    if smg is not None:
        for name in ("kvgate", f"kvgate --workers {args.workers}"):
            ratios = [k / s for k, s in zip(by_name[name].rps, smg.rps, strict=True)]
            print(
                f"{name} / smg per round: {', '.join(f'{r:.2f}' for r in ratios)}; median "
                f"{statistics.median(ratios):.2f} (target >= {TARGET_RATIO}, ratio "
                f"{statistics.median(ratios) / TARGET_RATIO:.2f})"
            )
    return 1 if any(t.failed for t in targets) else 0


if __name__ == "__main__":
    sys.exit(main())
