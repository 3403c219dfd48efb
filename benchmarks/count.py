"""A replay's cost against its baseline, counted rather than timed: instructions and estimated
cycles under valgrind, with only the replay itself instrumented.

CPU time on a shared machine drifts: on this project's 2-core VM the same pair of replays,
back to back, gave per-round ratios from 1.24x to 2.36x within minutes (2026-12-03). Counts do
not drift. This script runs each side of a comparison in its own process under
``valgrind --tool=callgrind --instr-atstart=no --cache-sim=yes --branch-sim=yes``; the process
loads its input and builds its manager uninstrumented, then turns instrumentation on
(``callgrind_control -i on``) for the replay alone and off after it. So nothing is subtracted:
the counts are the replay's own. Both sides run in parallel (one per core).

Reported per side, and as a ratio:

- ``Ir``: instructions executed;
- ``cycles``: valgrind's cycle estimate (the cachegrind manual's "CEst"), ``Ir + 10 Bm + 10 L1m
  + 100 LLm``: ``Bm`` mispredicted branches (conditional and indirect), ``L1m`` first-level
  misses (instruction and data), ``LLm`` last-level misses. The simulated caches are this
  machine's per core (``lscpu``: AMD EPYC, 32 KiB L1i and L1d, 1 MiB L2 per core; the 32 MiB L3
  is shared with other tenants, so the simulated last level is the L2): ``--l1 32768,8,64``,
  ``--ll 1048576,16,64`` (size, associativity, line). A replay whose working set outgrows the
  L2 (a host tier's 4,000 records, say) pays for it here, as it does in CPU time, and Ir alone
  does not show it.

Comparisons:

- ``tiers`` (issue 15, target at most 1.5x): `benchmarks/bench_tiers.py`'s replay of the
  bundled Mooncake trace through LRU over a 1,000-block metadata-only pool, without and with
  a 4,000-block metadata-only host tier;
- ``policy`` (issue 13, target at most 2x): `benchmarks/bench_sim.py`'s ``run_replay`` of the
  bundled Mooncake trace (once) at ``--capacity`` blocks (default 5,000), ``lru`` against
  ``--policy`` (default ``learned``).

    python benchmarks/count.py tiers
    python benchmarks/count.py policy --policy learned --capacity 5000

Each comparison takes about 80 seconds on 2 cores. Needs valgrind (``apt install valgrind``).
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

EVENTS = ("Ir", "I1mr", "D1mr", "D1mw", "ILmr", "DLmr", "DLmw", "Bcm", "Bim")
TARGETS = {"tiers": 1.5, "policy": 2.0}


def estimated_cycles(counts: dict[str, int]) -> int:
    """The cachegrind manual's cycle estimate: Ir + 10 Bm + 10 L1m + 100 LLm."""
    l1 = counts["I1mr"] + counts["D1mr"] + counts["D1mw"]
    ll = counts["ILmr"] + counts["DLmr"] + counts["DLmw"]
    return counts["Ir"] + 10 * (counts["Bcm"] + counts["Bim"]) + 10 * l1 + 100 * ll


def parse_counts(log: str) -> dict[str, int]:
    """The totals valgrind prints at exit (``Events :`` names them, ``Collected :`` counts
    them), as a dict over `EVENTS`."""
    names = re.search(r"^==\d+== Events\s*:\s*(.+)$", log, re.M)
    values = re.search(r"^==\d+== Collected\s*:\s*(.+)$", log, re.M)
    if names is None or values is None:
        raise RuntimeError("valgrind printed no event totals; its log ends with:\n"
                           + "\n".join(log.splitlines()[-15:]))
    counts = dict(zip(names.group(1).split(), map(int, values.group(1).split())))
    missing = [e for e in EVENTS if e not in counts]
    if missing:
        raise RuntimeError(f"valgrind's totals lack {missing}; it counted {sorted(counts)}")
    return {e: counts[e] for e in EVENTS}


# -- one side, in the instrumented child ------------------------------------------------------


def _instrument(on: bool) -> None:
    subprocess.run(["callgrind_control", "-i", "on" if on else "off", str(os.getpid())],
                   check=True, capture_output=True)


def run_side(comparison: str, side: str, policy: str, capacity: int) -> str:
    """Build one side uninstrumented, replay it instrumented; return what it served."""
    if comparison == "tiers":
        import bench_tiers

        requests, block_size = bench_tiers.load_requests()
        manager, stack = bench_tiers.build(block_size, 1000, 4000 if side == "new" else None)
        gc.collect()
        _instrument(True)
        bench_tiers.replay(manager, requests)
        _instrument(False)
        return str(bench_tiers.hits_of(manager, stack))
    import bench_sim

    stream = bench_sim.mooncake_stream(1)
    name = policy if side == "new" else "lru"
    gc.collect()
    _instrument(True)
    run = bench_sim.run_replay(stream, name, capacity)
    _instrument(False)
    return f"{name}: {run.hits} hits of {run.events}, {run.evictions} evictions"


# -- the parent ---------------------------------------------------------------------------------


def count_both(comparison: str, policy: str, capacity: int, l1: str, ll: str
               ) -> dict[str, tuple[dict[str, int], str]]:
    """Both sides under callgrind, in parallel: each side's counts and what it served."""
    valgrind = shutil.which("valgrind")
    if valgrind is None or shutil.which("callgrind_control") is None:
        raise SystemExit("count.py needs valgrind and callgrind_control on PATH "
                         "(apt install valgrind)")
    with tempfile.TemporaryDirectory(prefix="kvevict-count-") as tmp:
        procs = {}
        for side in ("base", "new"):
            cmd = [valgrind, "--tool=callgrind", "--instr-atstart=no", "--cache-sim=yes",
                   "--branch-sim=yes", f"--I1={l1}", f"--D1={l1}", f"--LL={ll}",
                   f"--callgrind-out-file={tmp}/{side}.out", sys.executable, __file__,
                   comparison, "--side", side, "--policy", policy, "--capacity",
                   str(capacity)]
            procs[side] = subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, text=True)
        out = {}
        for side, proc in procs.items():
            stdout, stderr = proc.communicate()
            if proc.returncode != 0:
                raise RuntimeError(f"the {side} side failed (exit {proc.returncode}):\n"
                                   + stderr[-3000:])
            out[side] = (parse_counts(stderr), stdout.strip())
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("comparison", choices=sorted(TARGETS))
    ap.add_argument("--policy", default="learned",
                    help="policy: the policy counted against lru (default learned)")
    ap.add_argument("--capacity", type=int, default=5000,
                    help="policy: pool size in blocks (default 5000)")
    ap.add_argument("--l1", default="32768,8,64",
                    help="simulated L1i and L1d: size,associativity,line (default 32 KiB)")
    ap.add_argument("--ll", default="1048576,16,64",
                    help="simulated last level: size,associativity,line (default 1 MiB)")
    ap.add_argument("--side", choices=("base", "new"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.side is not None:  # the instrumented child
        print(run_side(args.comparison, args.side, args.policy, args.capacity))
        return 0
    both = count_both(args.comparison, args.policy, args.capacity, args.l1, args.ll)
    base, new = both["base"][0], both["new"][0]
    label = {"tiers": ("untiered", "tiered"),
             "policy": ("lru", args.policy)}[args.comparison]
    print(f"{'side':<10} {'Ir':>9} {'cycles':>9} {'LL misses':>10} {'mispredicts':>12}  served")
    for name, (counts, served) in zip(label, both.values()):
        print(f"{name:<10} {counts['Ir'] / 1e9:8.3f}G {estimated_cycles(counts) / 1e9:8.3f}G "
              f"{(counts['ILmr'] + counts['DLmr'] + counts['DLmw']) / 1e6:9.2f}M "
              f"{(counts['Bcm'] + counts['Bim']) / 1e6:11.2f}M  {served}")
    ir = new["Ir"] / base["Ir"]
    cycles = estimated_cycles(new) / estimated_cycles(base)
    target = TARGETS[args.comparison]
    print(f"{label[1]} / {label[0]}: {ir:.3f}x by instructions, {cycles:.3f}x by estimated "
          f"cycles (target <= {target}x)")
    return 0 if max(ir, cycles) <= target else 1


if __name__ == "__main__":
    sys.exit(main())
