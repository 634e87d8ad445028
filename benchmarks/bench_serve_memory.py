"""Peak memory of ``vla-rl serve`` while many clients send large messages at once.

    python benchmarks/bench_serve_memory.py [--clients 15] [--message-mb 31] [--rounds 3] [--infer-ms 300]
                                            [--repo PATH] [-- SERVE_ARGS ...]

Exports a tiny random policy, starts ``python -m vla_rl.cli serve EXPORT --port 0 SERVE_ARGS`` in a subprocess (run
from ``--repo``, default this checkout, so another checkout's server can be measured the same way) and sends it one
request; then ``--clients`` raw websocket clients connect and each send ``--rounds`` messages of ``--message-mb`` MB
back to back before reading any reply: valid observations whose camera images make up the message (one image, or a
batch of them for messages over 12 MB; resized by the server to the policy's 32 px). Each inference takes
``--infer-ms`` more (a sleep added in the server process: a slow model, so that requests pile up as they would
behind a large policy). Prints the clients served and refused, the server's resident memory after the first request
("idle"), its peak (VmHWM) and the difference. A client that waits longer than websockets' 20 s keepalive timeout is
dropped (the server does not read from a client whose next request waits) and counts as neither.
"""

from __future__ import annotations

import argparse
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def tiny_export(folder: Path) -> Path:
    import torch

    from vla_rl.checkpoint.policy import save_policy
    from vla_rl.interop.export import export_policy
    from vla_rl.policies.architectures import make_policy
    from vla_rl.policies.normalize import NormStats, Stats
    from vla_rl.presets import policy_preset

    cfg = policy_preset("tiny")
    torch.manual_seed(0)
    save_policy(folder / "policy", make_policy(cfg), NormStats(Stats.identity(4), Stats.identity(2)),
                meta={"env_config": {"kind": "builtin"}, "sft": {"execute": 4, "num_steps": 3}})
    return export_policy(folder / "policy", folder / "export", dtype="fp32")


def memory_kb(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


SLOW_SERVER = """
import sys, time
import vla_rl.policies.exported as exported
run = exported.ExportedPolicy.run
def slow(self, batch):
    time.sleep({delay})
    return run(self, batch)
exported.ExportedPolicy.run = slow
from vla_rl.cli import main
sys.exit(main({argv!r}))
"""


def client(port: int, message: bytes, rounds: int, start: threading.Barrier, result: list) -> None:
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    try:
        ws = connect(f"ws://127.0.0.1:{port}", compression=None, max_size=None, open_timeout=60)
    except InvalidStatus as e:
        result.append(f"refused {e.response.status_code}")
        start.wait()
        return
    with ws:
        ws.recv(timeout=60)                     # the metadata
        start.wait()
        for _ in range(rounds):
            ws.send(message)
        replies = [ws.recv(timeout=300) for _ in range(rounds)]
    result.append("served" if not any(isinstance(r, str) for r in replies)
                  else f"error replies {[str(r)[:80] for r in replies if isinstance(r, str)]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=15)
    ap.add_argument("--message-mb", type=float, default=31.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--infer-ms", type=float, default=300.0, help="added to each inference (a slow model)")
    ap.add_argument("--repo", type=Path, default=ROOT, help="the checkout whose `vla_rl.cli serve` runs")
    ap.add_argument("serve_args", nargs="*", help="arguments for `vla-rl serve` (after --)")
    args = ap.parse_args()

    from vla_rl.interop.wire import pack

    with tempfile.TemporaryDirectory() as tmp:
        export = tiny_export(Path(tmp))
        argv = ["serve", str(export), "--port", "0", *args.serve_args]
        cmd = [sys.executable, "-c", SLOW_SERVER.format(delay=args.infer_ms / 1000, argv=argv)]
        proc = subprocess.Popen(cmd, cwd=args.repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
        try:
            port = None
            while port is None:
                line = lines.get(timeout=300)
                m = re.search(r"serving .* on ws://127\.0\.0\.1:(\d+)", line)
                port = int(m.group(1)) if m else None
            size = args.message_mb * 2**20
            n = int(np.ceil(size / (3 * 2000**2)))       # a batch where one image would pass the 2048-pixel side
            side = int((size / (3 * n)) ** 0.5)
            image = np.random.default_rng(0).integers(0, 256, (n, side, side, 3), dtype=np.uint8)
            message = pack({"image": image if n > 1 else image[0], "prompt": "move to the red square",
                            "state": np.zeros((n, 4) if n > 1 else 4, np.float32)})
            warm: list[str] = []   # one request first: what the first inference sets up is not counted
            client(port, message, 1, threading.Barrier(1), warm)
            time.sleep(1.0)
            idle = memory_kb(proc.pid)["VmRSS"]
            start = threading.Barrier(args.clients)
            result: list[str] = []
            threads = [threading.Thread(target=client, args=(port, message, args.rounds, start, result), daemon=True)
                       for _ in range(args.clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(600)
            peak = memory_kb(proc.pid)["VmHWM"]
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    served = result.count("served")
    refused = sum(r.startswith("refused") for r in result)
    other = [r for r in result if r != "served" and not r.startswith("refused")]
    print("| server | clients served / refused | message MB x rounds | idle RSS MB | peak RSS MB | peak - idle MB |")
    print("|---|---|---|---|---|---|")
    print(f"| `{args.repo.name} serve {' '.join(args.serve_args)}` | {served} / {refused} | "
          f"{len(message) / 2**20:.1f} x {args.rounds} | {idle / 1024:.0f} | {peak / 1024:.0f} | "
          f"{(peak - idle) / 1024:.0f} |")
    if other:
        print("other outcomes:", other)


if __name__ == "__main__":
    main()
