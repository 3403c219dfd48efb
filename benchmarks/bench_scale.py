"""Replay at trace scale: peak memory flat in the trace's length, time linear in it.

The trace is the bundled Mooncake trace (3,993 requests, 121,877 block accesses, 43,924
distinct 512-token blocks) repeated back to back until it holds ``--requests`` requests:
repetition ``k`` shifts every hash id by ``k * 43,924`` and every timestamp by ``k`` times
the trace's span plus one second, so each repetition is a new stretch of the same service
(new sessions, no reuse across repetitions) and the ids stay dense, as in a real trace. It is
written to a temporary Mooncake ``.jsonl`` file (about 300 bytes per request), and each
measurement streams it back through `kvevict.workloads.TraceFile`.

Each measurement runs in a **fresh subprocess**: ``kvevict.replay.replay(TraceFile(path,
"mooncake"), policy, --capacity)``, nothing else. The parent reads the child's peak
resident set size from the ``ru_maxrss`` of its resource usage (``os.wait4``, the
per-child form of ``resource.getrusage(RUSAGE_CHILDREN)``), so one measurement never
inherits another's peak. The peak includes the interpreter, numpy, torch and kvevict (about
250 MB); page-cache pages of the trace file do not count, mapped pages of Belady's files
do (a window of each at a time, 20 MB in all).

For each policy it measures ``--requests / --ratio`` and ``--requests`` requests (the
first lines of the same file) and reports wall and CPU seconds of the replay (reading the
trace included), requests per CPU second, peak RSS, the block hit ratio, and the CPU time
ratio over the request ratio (1.0: linear; CPU time, since other work on a shared machine
inflates wall time much more). Targets (issue
12): peak RSS at most 2 GB for LRU and Belady at 10M requests; time linear in requests.

``--components`` instead measures, at ``--requests`` and without the per-request Python
work that makes a full 10M run take hours on a small machine, the two parts whose memory
grows with the trace: the Mooncake reader's prefix-chain check (`IdTable.link` over every
request's ids) and Belady's backward pass (`NextUseFile.next_uses` over the ids file, written
with numpy here). Everything else a replay holds is the cache, measured flat by the full runs.

``--simulate`` instead measures the timed simulation as a user runs it: ``kvevict simulate
--trace <the repeated trace> --format mooncake --policies lru --gpu h100-sxm-80gb
--target-load 0.3 --no-sweep --jobs 1`` in a fresh subprocess, at ``--requests / --ratio``
and ``--requests`` requests, with the same peak RSS (``wait4``) and CPU seconds. A run holds
the cache and the requests in flight; what grows with the trace is per request: 60 bytes of
summary columns (`kvevict.run.RunColumns`), the Mooncake reader's prefix-chain table (8
bytes per distinct block id, 11 ids per request here) and the infinite cache's bit per
distinct id (`kvevict.run.InfiniteCache`). It prints the bytes per extra request. The load
of 0.3 keeps the queue bounded (at 0.7 LRU's misses on this trace overload the H100, the
queue and so the requests in flight grow with the trace: nothing a simulator can hold
flat). ``--checkout DIR`` runs another checkout's kvevict (e.g. the one before streaming).

Run from the repository root::

    python benchmarks/bench_scale.py --requests 1000000            # 100k and 1M
    python benchmarks/bench_scale.py --requests 10000000 --policies lru
    python benchmarks/bench_scale.py --requests 200000 --ratio 4 --capacity 5000
    python benchmarks/bench_scale.py --requests 10000000 --components
    python benchmarks/bench_scale.py --simulate --requests 480000 --ratio 4

``pytest benchmarks/bench_scale.py`` runs one quick check (the repeated trace's shape and a
small replay of it); the measurement itself is the script.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

try:
    import kvevict  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvevict.workloads import bundled_trace_path, read_mooncake

RSS_TARGET = 2 * 10**9  # bytes (2 GB), issue 12
DEFAULT_CAPACITY = 10_000  # blocks of 512 tokens: LRU hits about 0.42 of the blocks


def write_repeated_trace(path: str | os.PathLike[str], requests: int) -> dict[str, int]:
    """Write the bundled Mooncake trace repeated with shifted ids and timestamps, ``requests``
    lines in all (the last repetition cut short); return its shape."""
    base = read_mooncake(bundled_trace_path())
    ids = [np.asarray(r.block_hashes, dtype=np.int64) for r in base]
    stride_ids = int(max(int(a.max()) for a in ids if len(a))) + 1
    stamps = [round(r.arrival * 1000) for r in base]
    stride_ms = stamps[-1] + 1000
    lengths = [int(r.extra.get("input_length", r.num_tokens)) for r in base]
    outputs = [r.output_len for r in base]
    written = accesses = 0
    with open(os.fspath(path), "w", encoding="utf-8") as fh:
        rep = 0
        while written < requests:
            shift, dt = rep * stride_ids, rep * stride_ms
            lines = []
            for i in range(min(len(base), requests - written)):
                hashes = ", ".join(map(str, (ids[i] + shift).tolist()))
                lines.append(f'{{"timestamp": {stamps[i] + dt}, "input_length": {lengths[i]}, '
                             f'"output_length": {outputs[i]}, "hash_ids": [{hashes}]}}\n')
                accesses += len(ids[i])
            fh.writelines(lines)
            written += len(lines)
            rep += 1
    return {"requests": written, "accesses": accesses, "distinct_ids_per_repeat": stride_ids,
            "repetitions": rep}


def copy_head(src: str, dst: str, lines: int) -> None:
    """The first ``lines`` lines of ``src`` into ``dst``."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        for n, line in enumerate(fin):
            if n >= lines:
                break
            fout.write(line)


def child(trace: str, policy: str, capacity: int, workdir: str | None) -> None:
    """One measurement (run in a fresh interpreter): print the replay's result as JSON."""
    from kvevict.replay import replay
    from kvevict.workloads import TraceFile

    start, cpu = time.perf_counter(), time.process_time()
    result = replay(TraceFile(trace, "mooncake"), policy, capacity, workdir=workdir)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    print(json.dumps({"seconds": seconds, "cpu_seconds": cpu, "requests": result.requests,
                      "accesses": result.accesses, "hits": result.hits,
                      "block_hit_ratio": result.block_hit_ratio,
                      "evictions": result.evictions}))


def component(name: str, requests: int, workdir: str) -> None:
    """One part of the replay at full scale, without the per-request Python work (run in a
    fresh interpreter): print its seconds as JSON.

    - ``chains``: the Mooncake reader's prefix-chain check (`IdTable.link`) over every
      request's ids of the repeated trace: what the reader keeps grows with the distinct ids;
    - ``backward``: Belady's backward pass (`NextUseFile.next_uses`) over the ids file of the
      repeated trace, written here with numpy instead of the forward pass's request loop.
    """
    from kvevict.policies.belady import NextUseFile
    from kvevict.workloads import IdTable

    base = read_mooncake(bundled_trace_path())
    ids = [np.asarray(r.block_hashes, dtype=np.int64) for r in base]
    stride = int(max(int(a.max()) for a in ids)) + 1
    reps, rest = divmod(requests, len(base))
    start = time.perf_counter()
    if name == "chains":
        table = IdTable()
        lists = [a.tolist() for a in ids]
        for rep in range(reps + 1):
            shift = rep * stride
            for chain in lists[:len(base) if rep < reps else rest]:
                if table.link([h + shift for h in chain]) >= 0:
                    raise AssertionError("a broken chain in the repeated trace")
        extra = {"entries": len(table), "table_bytes": table.nbytes}
    elif name == "backward":
        root = tempfile.mkdtemp(prefix="kvevict-bench-backward-", dir=workdir)
        flat = np.concatenate(ids)
        counts = np.asarray([len(a) for a in ids], dtype=np.int64)
        needs = np.asarray([-(-r.num_tokens // 512) for r in base], dtype=np.int64)
        offsets = [np.zeros(1, dtype=np.int64)]
        accesses = 0
        with open(os.path.join(root, "ids.i64"), "wb") as fid, \
                open(os.path.join(root, "need.i64"), "wb") as fneed:
            for rep in range(reps + 1):
                n = len(base) if rep < reps else rest
                part = counts[:n]
                (flat[:int(part.sum())] + rep * stride).tofile(fid)
                needs[:n].tofile(fneed)
                offsets.append(accesses + np.cumsum(part))
                accesses += int(part.sum())
        np.concatenate(offsets).tofile(os.path.join(root, "offsets.i64"))
        future = NextUseFile(root, num_requests=requests, num_accesses=accesses,
                             num_slots=stride * (reps + 1), base=stride * (reps + 1),
                             max_need=int(needs.max()), block_size=512, spill=False)
        written = time.perf_counter()
        future.next_uses(None)
        extra = {"accesses": accesses, "write_seconds": written - start,
                 "bytes_on_disk": future.bytes_on_disk}
        start = written
        future.close()
    else:
        raise SystemExit(f"unknown component {name!r}")
    print(json.dumps({"seconds": time.perf_counter() - start, "cpu_seconds": time.process_time(),
                      "requests": requests, **extra}))


def measure(trace: str, policy: str, capacity: int, workdir: str | None,
            component_of: int | None = None) -> dict:
    """Run `child` (or `component` ``policy`` of ``component_of`` requests) in a subprocess;
    its JSON plus ``peak_rss`` (bytes) from ``wait4``."""
    command = [sys.executable, os.path.abspath(__file__), "--child", trace, "--policy", policy,
               "--capacity", str(capacity)]
    if component_of is not None:
        command = [sys.executable, os.path.abspath(__file__), "--component", policy,
                   "--requests", str(component_of)]
    if workdir:
        command += ["--workdir", workdir]
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(command)} exited with {proc.returncode}")
    result = json.loads(out.decode().strip().splitlines()[-1])
    result["peak_rss"] = usage.ru_maxrss * 1024  # KiB on Linux
    return result


#: the ``kvevict simulate`` options of ``--simulate`` after the trace: one policy, the
#: H100 profile, a stable load, the box's capacity only, one process
SIMULATE_ARGS = ("--format", "mooncake", "--gpu", "h100-sxm-80gb", "--target-load", "0.3",
                 "--no-sweep", "--jobs", "1", "--quiet")


def measure_simulate(trace: str, policies: str, checkout: str, out_dir: str) -> dict:
    """``kvevict simulate`` of ``trace`` (`SIMULATE_ARGS`, ``--policies policies``, results
    in ``out_dir``) in a subprocess running ``checkout``'s kvevict: wall and CPU seconds and
    peak RSS (``wait4``), the requests and LRU's token hit ratio from its results.json."""
    trace, out_dir, checkout = (os.path.abspath(p) for p in (trace, out_dir, checkout))
    command = [sys.executable, "-m", "kvevict.cli", "simulate", "--trace", trace,
               "--policies", policies, *SIMULATE_ARGS, "--out", out_dir]
    env = dict(os.environ)
    env["PYTHONPATH"] = checkout
    start = time.perf_counter()
    # run in the checkout: ``-m`` puts the working directory first on sys.path, so a run
    # from another checkout would import that one's kvevict
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, env=env, cwd=checkout)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status):
        raise RuntimeError(f"{' '.join(command)} exited with "
                           f"{os.waitstatus_to_exitcode(status)}")
    with open(os.path.join(out_dir, "results.json"), encoding="utf-8") as fh:
        results = json.load(fh)
    lru = next(c for c in results["cells"] if c["policy"] == "lru")
    return {"seconds": seconds, "cpu_seconds": usage.ru_utime + usage.ru_stime,
            "peak_rss": usage.ru_maxrss * 1024, "requests": lru["requests"],
            "token_hit_ratio": lru["token_hit_ratio"], "ttft_p95": lru["ttft_p95"],
            "measured_load": results["load"]["measured_load"]}


def simulate_main(requests: int, ratio: int, policies: str, checkout: str,
                  workdir: str | None) -> int:
    """``--simulate``: the two sizes of the repeated trace through ``kvevict simulate``; the
    table, then the bytes per extra request and the CPU time ratio."""
    root = tempfile.mkdtemp(prefix="kvevict-bench-scale-", dir=workdir)
    try:
        long_path = os.path.join(root, "long.jsonl")
        short_path = os.path.join(root, "short.jsonl")
        shape = write_repeated_trace(long_path, requests)
        copy_head(long_path, short_path, requests // ratio)
        print(f"trace: {shape['requests']:,} requests, {shape['accesses']:,} block accesses; "
              f"kvevict simulate {' '.join(SIMULATE_ARGS)} --policies {policies} "
              f"(kvevict from {checkout})", flush=True)
        print("| requests | wall s | CPU s | requests/s (CPU) | peak RSS | LRU token hit | "
              "LRU TTFT p95 s | measured load |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|", flush=True)
        pair = []
        for i, path in enumerate((short_path, long_path)):
            r = measure_simulate(path, policies, checkout, os.path.join(root, f"out{i}"))
            pair.append(r)
            print(f"| {r['requests']:,} | {r['seconds']:.0f} | {r['cpu_seconds']:.0f} | "
                  f"{r['requests'] / r['cpu_seconds']:,.0f} | {r['peak_rss'] / 1e6:,.0f} MB | "
                  f"{r['token_hit_ratio']:.4f} | {r['ttft_p95']:.3f} | "
                  f"{r['measured_load']:.3f} |", flush=True)
        a, b = pair
        per_request = (b["peak_rss"] - a["peak_rss"]) / (b["requests"] - a["requests"])
        linear = (b["cpu_seconds"] / a["cpu_seconds"]) / (b["requests"] / a["requests"])
        print(f"\npeak RSS grows {per_request:,.0f} bytes per extra request; CPU time ratio / "
              f"request ratio = {linear:.2f} (1.00: linear)")
        return 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1_000_000,
                        help="requests of the long run (default %(default)s)")
    parser.add_argument("--ratio", type=int, default=10,
                        help="the short run has --requests / RATIO requests (default 10)")
    parser.add_argument("--policies", default=None,
                        help="comma-separated policies (default: lru,belady for the replay, "
                             "lru for --simulate)")
    parser.add_argument("--capacity", type=int, default=DEFAULT_CAPACITY,
                        help="pool size in 512-token blocks (default %(default)s)")
    parser.add_argument("--workdir", default=None,
                        help="directory for the trace and Belady's files (default: a "
                             "temporary directory, removed at the end)")
    parser.add_argument("--components", action="store_true",
                        help="instead: time and size, at --requests, the two parts of the "
                             "replay whose memory grows with the trace (the reader's chain "
                             "check, Belady's backward pass), without the per-request work")
    parser.add_argument("--simulate", action="store_true",
                        help="instead: kvevict simulate (the timed simulation) of the "
                             "repeated trace at the two sizes, peak RSS and CPU time")
    parser.add_argument("--checkout", default=str(Path(__file__).resolve().parents[1]),
                        help="with --simulate: the checkout whose kvevict runs (default: "
                             "this one)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--component", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--policy", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.policy, args.capacity, args.workdir)
        return 0
    if args.component:
        component(args.component, args.requests, args.workdir)
        return 0
    if args.simulate:
        if args.requests < args.ratio or args.ratio < 2:
            parser.error("--requests must be at least --ratio, and --ratio at least 2")
        return simulate_main(args.requests, args.ratio, args.policies or "lru", args.checkout,
                             args.workdir)
    if args.components:
        root = tempfile.mkdtemp(prefix="kvevict-bench-scale-", dir=args.workdir)
        try:
            print("| part | requests | seconds | peak RSS | details |")
            print("|---|---:|---:|---:|---|", flush=True)
            for name in ("chains", "backward"):
                r = measure("", name, 0, root, component_of=args.requests)
                details = ", ".join(f"{k} {v:,.0f}" if isinstance(v, (int, float)) else k
                                    for k, v in r.items()
                                    if k not in ("seconds", "cpu_seconds", "requests",
                                                 "peak_rss"))
                print(f"| {name} | {r['requests']:,} | {r['seconds']:.1f} | "
                      f"{r['peak_rss'] / 1e6:,.0f} MB | {details} |", flush=True)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        return 0
    if args.requests < args.ratio or args.ratio < 2:
        parser.error("--requests must be at least --ratio, and --ratio at least 2")
    root = tempfile.mkdtemp(prefix="kvevict-bench-scale-", dir=args.workdir)
    try:
        long_path = os.path.join(root, "long.jsonl")
        short_path = os.path.join(root, "short.jsonl")
        start = time.perf_counter()
        shape = write_repeated_trace(long_path, args.requests)
        short = args.requests // args.ratio
        copy_head(long_path, short_path, short)
        print(f"trace: {shape['requests']:,} requests, {shape['accesses']:,} block accesses, "
              f"{shape['repetitions']} repetitions of the bundled Mooncake trace "
              f"({os.path.getsize(long_path) / 1e9:.2f} GB, written in "
              f"{time.perf_counter() - start:.0f} s); capacity {args.capacity:,} blocks",
              flush=True)
        print("| policy | requests | wall s | CPU s | requests/s (CPU) | peak RSS | "
              "block hit ratio |")
        print("|---|---:|---:|---:|---:|---:|---:|", flush=True)
        rows = []
        policies = args.policies or "lru,belady"
        for policy in [p.strip() for p in policies.split(",") if p.strip()]:
            pair = []
            for path in (short_path, long_path):
                r = measure(path, policy, args.capacity, root)
                pair.append(r)
                print(f"| {policy} | {r['requests']:,} | {r['seconds']:.1f} | "
                      f"{r['cpu_seconds']:.1f} | {r['requests'] / r['cpu_seconds']:,.0f} | "
                      f"{r['peak_rss'] / 1e6:,.0f} MB | {r['block_hit_ratio']:.4f} |",
                      flush=True)
            rows.append((policy, pair))
        print()
        ok = True
        for policy, (a, b) in rows:
            linear = (b["cpu_seconds"] / a["cpu_seconds"]) / (b["requests"] / a["requests"])
            within = b["peak_rss"] <= RSS_TARGET
            ok &= within
            print(f"{policy}: CPU time ratio / request ratio = {linear:.2f} (1.00: linear); peak "
                  f"RSS {b['peak_rss'] / 1e6:,.0f} MB at {b['requests']:,} requests vs "
                  f"{a['peak_rss'] / 1e6:,.0f} MB at {a['requests']:,} "
                  f"({'within' if within else 'OVER'} the 2 GB target)")
        return 0 if ok else 1
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_repeated_trace_shifts_ids_and_replays(tmp_path):
    """The repeated trace: shifted ids and times, readable, and its second repetition hits
    exactly what the first did (no reuse across repetitions)."""
    from kvevict.replay import replay
    from kvevict.workloads import TraceFile

    path = tmp_path / "t.jsonl"
    shape = write_repeated_trace(path, 2 * 3993)
    assert shape == {"requests": 7986, "accesses": 2 * 121_877,
                     "distinct_ids_per_repeat": 43_924, "repetitions": 2}
    reqs = read_mooncake(path)
    assert reqs[3993].block_hashes[0] == reqs[0].block_hashes[0] + 43_924
    assert reqs[3993].arrival > reqs[3992].arrival
    one = replay(TraceFile(bundled_trace_path(), "mooncake"), "lru", 50_000)
    two = replay(TraceFile(path, "mooncake"), "lru", 100_000)
    assert two.hits == 2 * one.hits and two.evictions == 0


if __name__ == "__main__":
    sys.exit(main())
