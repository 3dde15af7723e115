"""kvgate as Envoy's endpoint picker: requests per second, and the latency the ext_proc hop adds.

Two zero-engine-time engines (nginx answering a canned vLLM completion, as
``benchmarks.speed.throughput``) stand in for vLLM, so what is measured is the routing path.
Throughput (``wrk -t1 -c16``, short non-streaming completions, keep-alive), interleaved rounds:

* ``engine``: straight to one engine (the ceiling);
* ``envoy -> engine``: Envoy 1.40 with a static route to one engine (no picker);
* ``envoy + epp (buffered, python)`` / ``(duplex, native)`` ...: Envoy in the Inference
  Extension's layout (``deploy/envoy/envoy.yaml``: ext_proc to ``kvgate epp``, ORIGINAL_DST
  by header), request body ``BUFFERED`` or ``FULL_DUPLEX_STREAMED``, the picker's front end
  ``python`` (grpc.aio) or ``native`` (kvgate-epp-front, ``scripts/setup_native.sh``);
* ``kvgate serve``: the HTTP proxy, one process;
* ``smg``: SMG (``smg launch``, cache_aware) when its binary is given.

The hop (``wrk -t1 -c1``: one request at a time, so latency is not queueing): p50 and p99 of
Envoy + epp minus those of Envoy -> engine, for the short prompt and for a 200 KB prompt
(``--big-kb``). The CPU per request of a target counts all its processes (Envoy and the
picker). Prints the rows, the ratios Envoy + epp / SMG and / kvgate serve per round, and the
targets: Envoy + epp >= 1.0x SMG's req/s; the hop <= 1 ms p50 and <= 5 ms p99; a 200 KB
prompt adds <= 20 ms. Needs wrk and nginx (``scripts/setup_bench.sh``), Envoy
(``scripts/setup_envoy.sh``), and for the SMG row SMG in a virtualenv of its own.

    python -m benchmarks.epp.throughput [--seconds 5] [--rounds 2] [--big-kb 200]
        [--policy cache_aware] [--smg /work/team/smg-venv/bin/smg] [--modes buffered,duplex]
        [--frontends python,native] [--py-spy DIR] [--ab "PICKER FLAGS"] [--no-serve]

``--ab``: each mode's picker runs twice, the second (rows tagged B) with the extra flags,
interleaved with the rest: an A/B under the same machine load.
"""

from __future__ import annotations

import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

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
from benchmarks.epp.wrk import post_script, wrk
from benchmarks.speed.throughput import nginx_config, start_kvgate
from gateway.cli.demo import free_port
from tests.envoy.rig import (
    MODES,
    envoy_binary,
    render,
    start_envoy,
    start_epp,
    wait,
)

TARGET_SMG = 1.0
HOP_P50_MS, HOP_P99_MS, BIG_MS = 1.0, 5.0, 20.0


def direct_config(mode: str, listen_port: int, admin_port: int, engine_port: int) -> str:
    """The same Envoy, without the picker: the route goes to one engine (a STATIC cluster)."""
    doc: dict[str, Any] = yaml.safe_load(
        render(mode, listen_port=listen_port, admin_port=admin_port, epp_port=1)
    )
    res = doc["static_resources"]
    hcm = res["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = [f for f in hcm["http_filters"] if "ext_proc" not in f["name"]]
    hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["cluster"] = "engine"
    address = {"socket_address": {"address": "127.0.0.1", "port_value": engine_port}}
    res["clusters"] = [
        {
            "name": "engine",
            "type": "STATIC",
            "connect_timeout": "5s",
            "load_assignment": {
                "cluster_name": "engine",
                "endpoints": [{"lb_endpoints": [{"endpoint": {"address": address}}]}],
            },
        }
    ]
    return yaml.safe_dump(doc)


def start_direct_envoy(workdir: Path, engine_port: int) -> Target:
    port, admin = free_port(), free_port()
    config = workdir / "envoy-direct.yaml"
    config.write_text(direct_config("buffered", port, admin, engine_port), encoding="utf-8")
    cmd = [str(envoy_binary()), "-c", str(config), "--log-level", "warning"]
    cmd += ["--concurrency", "2", "--base-id", str(port)]
    proc = spawn(cmd, workdir / "envoy-direct.log")
    wait_ready(f"http://127.0.0.1:{admin}", "/ready", proc)
    return Target("envoy -> engine", f"http://127.0.0.1:{port}", procs=[proc])


def big_prompt(kb: int, seed: int = 7) -> str:
    rng = random.Random(seed)
    words = [f"w{rng.randrange(50_000)}" for _ in range(kb * 1024 // 6)]
    return " ".join(words)[: kb * 1024]


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def measure(t: Target, url_path: str, seconds: float, script: Path, connections: int) -> None:
    def run() -> tuple[float, float, float, int]:
        r = wrk(t.url + url_path, seconds, script, connections)
        return r.rps, r.p50, r.p99, r.bad

    t.measure(seconds, run)


def main() -> int:
    ap = benchmark_parser(__doc__, "benchmarks.epp.throughput")
    ap.add_argument("--seconds", type=float, default=5.0, help="per wrk run (default 5)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    ap.add_argument("--big-kb", type=int, default=200, help="the big prompt's size (KB)")
    ap.add_argument("--policy", default="cache_aware", help="kvgate's policy (both front ends)")
    ap.add_argument("--modes", default="buffered,duplex", help="Envoy body modes to measure")
    ap.add_argument("--smg", default="/work/team/smg-venv/bin/smg", help="SMG's binary")
    ap.add_argument(
        "--py-spy",
        metavar="DIR",
        help="profile each picker with py-spy during its first throughput run; collapsed "
        "stacks to DIR/epp-MODE.txt and the top functions printed",
    )
    ap.add_argument(
        "--native",
        action="store_true",
        help="with --py-spy: native (C) frames and thread ids in the stacks (py-spy pauses the "
        "picker for each sample: its throughput row is lower)",
    )
    ap.add_argument(
        "--ab",
        metavar="FLAGS",
        help="also run each mode's picker with these extra flags (rows tagged B), interleaved "
        "with the others: an A/B on the same load",
    )
    ap.add_argument(
        "--frontends",
        default="python,native",
        help="kvgate epp --frontend values to measure (default python,native; native needs "
        "scripts/setup_native.sh)",
    )
    ap.add_argument("--no-serve", action="store_true", help="leave out the kvgate serve row")
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if not all(m in MODES for m in modes):
        ap.error(f"--modes: choose from {sorted(MODES)}")
    for tool in ("wrk", "nginx"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            print(f"{tool} is needed: scripts/setup_bench.sh installs it", file=sys.stderr)
            return 2
    envoy_binary()  # fails with the setup script's name when Envoy is missing
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-bench-epp-"))
    short = workdir / "short.lua"
    short.write_text(post_script(None))
    big = workdir / "big.lua"
    big.write_text(post_script(big_prompt(args.big_kb)))
    ports = [free_port(), free_port()]
    engines = [f"http://127.0.0.1:{p}" for p in ports]
    (workdir / "nginx.conf").write_text(nginx_config(workdir, ports))
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    subprocess.run([nginx, "-c", str(workdir / "nginx.conf"), "-p", str(workdir)], check=True,
                   capture_output=True)  # fmt: skip
    targets: list[Target] = [Target("engine (nginx) alone", engines[0])]
    epps: dict[str, Target] = {}
    try:
        direct = start_direct_envoy(workdir, ports[0])
        targets.append(direct)
        frontends = [f for f in args.frontends.split(",") if f]
        variants = [("", [])] + ([("B", args.ab.split())] if args.ab is not None else [])
        for mode in modes:
            for frontend in frontends:
                for tag, more in variants:
                    name = f"{mode}, {frontend}" if len(frontends) > 1 else mode
                    key = f"{name} {tag}".strip()
                    flags = ["--log-level", "warning", "--fallbacks", "0"]  # one ip:port
                    flags += ["--frontend", frontend, *more]
                    epp, grpc_port = start_epp(
                        workdir,
                        engines,
                        policy=args.policy,
                        name=f"epp-{mode}-{frontend}{tag}",
                        extra=flags,
                    )
                    envoy = start_envoy(
                        workdir, mode, grpc_port, name=f"envoy-{mode}-{frontend}{tag}"
                    )
                    wait(envoy.epp_healthy, 300, "Envoy sees the picker healthy", epp)
                    t = Target(
                        f"envoy + epp ({key})", envoy.url, procs=[envoy.proc.popen, epp.popen]
                    )
                    targets.append(t)
                    epps[key] = t
        if args.ab is not None:
            print(f"B: kvgate epp {args.ab}", file=sys.stderr)
        env = {"KVGATE_LOG_REQUESTS": "false", "KVGATE_POLICY__NAME": args.policy}
        if not args.no_serve:
            url, proc = start_kvgate(workdir, "kvgate", engines, 1, env)
            targets.append(Target("kvgate serve", url, procs=[proc]))
        smg = start_smg(args.smg, engines, workdir)
        if smg is not None:
            targets.append(smg)
        path = "/v1/completions"
        for t in targets:  # warm-up: connections, caches
            wrk(t.url + path, 1, short, 16)
        load_before = os.getloadavg()
        for rnd in range(args.rounds):
            for t in targets:
                mode = next((m for m, e in epps.items() if e is t), None)
                spy = None
                if args.py_spy and rnd == 0 and mode is not None:
                    spy = start_py_spy(
                        Path(args.py_spy), mode, t.procs[1].pid, args.seconds, args.native
                    )
                measure(t, path, args.seconds, short, 16)
                if spy is not None:
                    spy.wait(60)
        # the hop: one request at a time, short and big prompts
        hop = {name: Target(name, t.url, procs=t.procs) for name, t in
               [("direct", direct), *epps.items()]}  # fmt: skip
        hop_big = {name: Target(name, t.url, procs=t.procs) for name, t in hop.items()}
        for _ in range(args.rounds):
            for name, t in hop.items():
                measure(t, path, args.seconds, short, 1)
                measure(hop_big[name], path, args.seconds, big, 1)
        load_after = os.getloadavg()
    finally:
        stop_processes([p for t in targets for p in t.procs])
        stop = [nginx, "-c", str(workdir / "nginx.conf"), "-p", str(workdir), "-s", "stop"]
        subprocess.run(stop, check=False, capture_output=True)
    print(
        f"wrk -t1 -c16 (throughput) and -c1 (hop), {args.seconds:g} s x {args.rounds} "
        f"interleaved rounds, 2 nginx engines, policy {args.policy}, {os.cpu_count()} cores; "
        f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after"
    )
    print(f"{'target':<32} {'req/s median':>12} {'min':>8} {'max':>8} {'p50 ms':>7} "
          f"{'p99 ms':>7} {'CPU us/req':>10}")  # fmt: skip
    for t in targets:
        print(
            f"{t.name:<32} {median(t.rps):12,.0f} {min(t.rps):8,.0f} {max(t.rps):8,.0f} "
            f"{median(t.p50):7.2f} {median(t.p99):7.2f}"
            + (f" {median(t.cpu_us):10.0f}" if t.cpu_us else f" {'-':>10}")
            + (f"  ({t.failed} failed)" if t.failed else "")
        )
    for t in targets:
        if len(t.cpu_split) > 1:
            parts = sorted(t.cpu_split.items(), key=lambda kv: -median(kv[1]))
            print(f"  {t.name} CPU us/req by process: "
                  + ", ".join(f"{name} {median(v):.0f}" for name, v in parts))  # fmt: skip
    by_name = {t.name: t for t in targets}
    for mode, t in epps.items():
        for other in ("smg", "kvgate serve"):
            if other in by_name:
                ratios = [a / b for a, b in zip(t.rps, by_name[other].rps, strict=True)]
                goal = f" (target >= {TARGET_SMG})" if other == "smg" else ""
                print(f"envoy + epp ({mode}) / {other} per round: "
                      f"{', '.join(f'{r:.2f}' for r in ratios)}; median "
                      f"{statistics.median(ratios):.2f}{goal}")  # fmt: skip
    base, base_big = hop["direct"], hop_big["direct"]
    print(f"\nthe ext_proc hop, one request at a time (wrk -c1); direct: Envoy -> engine "
          f"p50 {median(base.p50):.3f} ms p99 {median(base.p99):.3f} ms, {args.big_kb} KB prompt "
          f"p50 {median(base_big.p50):.3f} ms p99 {median(base_big.p99):.3f} ms")  # fmt: skip
    for mode in epps:
        h, hb = hop[mode], hop_big[mode]
        d50, d99 = median(h.p50) - median(base.p50), median(h.p99) - median(base.p99)
        b50 = median(hb.p50) - median(base_big.p50)
        print(
            f"{mode:<18} hop p50 +{d50:.3f} ms (target <= {HOP_P50_MS}), p99 +{d99:.3f} ms "
            f"(target <= {HOP_P99_MS}); {args.big_kb} KB prompt: p50 +{b50:.3f} ms, p99 "
            f"+{median(hb.p99) - median(base_big.p99):.3f} ms (target <= {BIG_MS}); "
            f"CPU {median(h.cpu_us):.0f} / {median(hb.cpu_us):.0f} us per request"
            + (f"  ({h.failed + hb.failed} failed)" if h.failed + hb.failed else "")
        )
    for mode in epps if args.py_spy else ():
        out = Path(args.py_spy) / f"epp-{mode}.txt"
        if out.exists():
            print(f"\npy-spy, picker ({mode}), share of samples with the function on the stack:")
            for share, fn in top_functions(out):
                print(f"  {share:6.1%}  {fn}")
    return 1 if any(t.failed for t in [*targets, *hop.values(), *hop_big.values()]) else 0


if __name__ == "__main__":
    sys.exit(main())
