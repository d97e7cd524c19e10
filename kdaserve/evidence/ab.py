"""Interleaved A/B of two configurations of one model, with an A/A noise estimate (`kdaserve ab`).

Each round serves A, B, B, A (one `kdaserve serve` process at a time on this machine, each warmed
up, then driven by bench/serve_client.py with the same prompts). Per metric (output tok/s, TTFT,
TPOT, ITL; mean and p99) the report gives B - A over the 2 x rounds (A, B) pairs as a mean with its
standard error and 95% interval, and the A/A difference (a round's first A against its last A):
a difference is called real only when its interval excludes 0 and it clears the A/A noise
(bench/stats.py). Provenance: for each arm, the backends it resolved to and the kernels (or, on
a CPU, the ops) that ran in a short profiled generation, so an A/B cannot silently compare one
path with itself. Results: a JSON file with everything, plots (matplotlib), the table last."""

from __future__ import annotations

import json
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kdaserve.evidence.serve_client import benchmark
from kdaserve.evidence.stats import paired_difference

# metric -> True when larger is better
METRICS = {"output_throughput": True, "request_throughput": True, "mean_ttft_ms": False, "p99_ttft_ms": False,
           "mean_tpot_ms": False, "p99_tpot_ms": False, "mean_itl_ms": False, "p99_itl_ms": False}
ORDER = ("A", "B", "B", "A")


def provenance(model: str, flags: str, prompts: list[list[int]], timeout: float = 1200) -> dict:
    """What ran in this arm (bench/provenance.py), in a process of its own: the engine it builds
    gives its GPU memory back when that process ends, before any server of the A/B starts."""
    with tempfile.TemporaryDirectory() as tmp:
        request, answer = Path(tmp) / "request.json", Path(tmp) / "answer.json"
        request.write_text(json.dumps({"model": model, "flags": flags, "prompts": prompts[:2]}))
        done = subprocess.run([sys.executable, "-m", "kdaserve.evidence.provenance", str(request), str(answer)],
                              capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"the provenance run for flags {flags!r} exited with {done.returncode}: "
                               f"{done.stderr[-2000:]}")
        return json.loads(answer.read_text())


def distinguishing_kernels(prov: dict) -> dict[str, list[dict]]:
    """Per arm, the kernels (ops) that ran only in that arm: what tells the two paths apart, where
    the most frequent kernels (copies, GEMMs, MoE) are the same in both."""
    names = {arm: {k["name"] for k in p["kernels"]} for arm, p in prov.items()}
    return {arm: [k for k in p["kernels"] if all(k["name"] not in names[o] for o in names if o != arm)]
            for arm, p in prov.items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, flags: str, startup_timeout: float) -> tuple[subprocess.Popen, str]:
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "kdaserve.cli", "serve", model, "--port", str(port), "--log-level", "warning",
           *shlex.split(flags)]
    # Its log goes to a file, not a pipe: a pipe nobody reads during the run fills up and stalls the server.
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"the server for flags {flags!r} exited with {proc.returncode}: {log.read()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"the server for flags {flags!r} did not answer /health within {startup_timeout:.0f} s")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run(model: str, flags: dict[str, str], prompts: list[list[int]], output_len: int, rounds: int, concurrency: int,
        warmup_prompts: int = 4, startup_timeout: float = 600, log=print) -> dict:
    """The A/B: `flags` maps "A" and "B" to engine flags. Returns the report (JSON-ready).
    Each server's untimed warm-up sends at least `concurrency` prompts, so batch shapes the timed
    run reaches are compiled and autotuned before it (docs/evidence.md)."""
    warmup_prompts = max(warmup_prompts, concurrency)
    runs = []
    for r in range(rounds):
        for position, arm in enumerate(ORDER):
            proc, url = start_server(model, flags[arm], startup_timeout)
            try:
                name = model
                benchmark(url, name, prompts[:warmup_prompts], output_len, concurrency)   # warm-up, untimed
                res = benchmark(url, name, prompts, output_len, concurrency)
            finally:
                stop_server(proc)
            if res["failed"]:
                raise RuntimeError(f"arm {arm}: {res['failed']} requests failed: {[e for e in res['errors'] if e][:3]}")
            runs.append({"round": r, "position": position, "arm": arm, "result": res})
            log(f"  round {r + 1} {arm}: {res['output_throughput']:.1f} out tok/s, TTFT {res['mean_ttft_ms']:.1f} ms, "
                f"ITL {res['mean_itl_ms']:.2f} ms")
    return {"model": model, "flags": flags, "rounds": rounds, "order": list(ORDER), "num_prompts": len(prompts),
            "input_len": len(prompts[0]), "output_len": output_len, "max_concurrency": concurrency,
            "runs": runs, "comparison": compare(runs)}


def compare(runs: list[dict]) -> dict:
    out = {}
    for metric, higher_better in METRICS.items():
        def at(arm, position):
            return [x["result"][metric] for x in runs if x["arm"] == arm and x["position"] == position]

        a_first, a_last, b_first, b_last = at("A", 0), at("A", 3), at("B", 1), at("B", 2)
        diff = paired_difference(a_first + a_last, b_first + b_last)
        noise = paired_difference(a_first, a_last)
        a_mean = sum(a_first + a_last) / len(a_first + a_last)
        out[metric] = {"a": a_mean, "b": sum(b_first + b_last) / len(b_first + b_last), "b_minus_a": diff.mean,
                       "se": diff.se, "ci95": [diff.low, diff.high], "relative": diff.mean / a_mean if a_mean else None,
                       "aa_difference": noise.mean, "aa_ci95": [noise.low, noise.high], "real": diff.clears(noise),
                       "b_better": (diff.mean > 0) == higher_better}
    return out


def table(report: dict) -> str:
    rows = ["| metric | A | B | B - A (95% CI) | relative | A/A difference (95% CI) | verdict |", "|---|---|---|---|---|---|---|"]
    for metric, c in report["comparison"].items():
        verdict = ("B better" if c["b_better"] else "B worse") if c["real"] else "within noise"
        rel = f"{c['relative']:+.1%}" if c["relative"] is not None else "-"
        rows.append(f"| {metric} | {c['a']:.2f} | {c['b']:.2f} | {c['b_minus_a']:+.2f} ({c['ci95'][0]:+.2f} .. "
                    f"{c['ci95'][1]:+.2f}) | {rel} | {c['aa_difference']:+.2f} ({c['aa_ci95'][0]:+.2f} .. "
                    f"{c['aa_ci95'][1]:+.2f}) | {verdict} |")
    return "\n".join(rows)


def plots(report: dict, out_dir: Path) -> list[Path]:
    """Per-run output throughput (A, B, and the A/A pairs) and latency distributions; [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = report["runs"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for arm, color in (("A", "tab:blue"), ("B", "tab:orange")):
        xs = [i for i, x in enumerate(runs) if x["arm"] == arm]
        ax.plot(xs, [runs[i]["result"]["output_throughput"] for i in xs], "o", color=color, label=arm)
    for r in range(report["rounds"]):   # the A/A pair of each round
        first, last = 4 * r, 4 * r + 3
        ax.plot([first, last], [runs[first]["result"]["output_throughput"], runs[last]["result"]["output_throughput"]],
                "--", color="tab:blue", alpha=0.5)
    ax.set_xlabel("run (A B B A per round)")
    ax.set_ylabel("output tok/s")
    ax.legend()
    fig.tight_layout()
    p1 = out_dir / "ab_throughput.png"
    fig.savefig(p1, dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for arm, color in (("A", "tab:blue"), ("B", "tab:orange")):
        ttft = [t * 1000 for x in runs if x["arm"] == arm for t in x["result"]["ttfts"] if t is not None]
        itl = [t * 1000 for x in runs if x["arm"] == arm for row in x["result"]["itls"] for t in row]
        for ax, values, label in ((axes[0], ttft, "TTFT (ms)"), (axes[1], itl, "ITL (ms)")):
            if values:
                ax.hist(values, bins=40, alpha=0.5, color=color, label=arm)
            ax.set_xlabel(label)
    axes[0].legend()
    fig.tight_layout()
    p2 = out_dir / "ab_latency.png"
    fig.savefig(p2, dpi=110)
    plt.close(fig)
    return [p1, p2]


def save(report: dict, path: Path) -> None:
    path.write_text(json.dumps(report, indent=1))
