"""Latency of an exported policy: one inference called directly vs the round trip through ``vla-rl serve``.

    python benchmarks/bench_serve.py [--presets tiny,small] [--device cpu] [--repeats 30] [--threads 1]
                                     [--weights fp32|bf16] [--dtype auto] [--image-size N]

For each preset a policy with random weights is built in memory as the :class:`ExportedPolicy` that
``load_exported`` returns (weights in ``--weights``, computed in ``--dtype``: auto = bf16 weights in bf16 on a GPU,
fp32 on a CPU), with the preset's cameras, K = 10 ODE steps and one observation of random camera images
(``--image-size``, default: the policy's own) and state. "direct" times ``policy.infer(obs)``; "server" times
openpi-client's ``WebsocketClientPolicy.infer(obs)`` against a server on a loopback port in this process (our own
msgpack client when openpi-client is not installed): message packing, the websocket, validation, inference and the
reply. The two are called alternately (``--repeats`` times each, after 3 warm-ups) so both see the same machine load;
prints a markdown table of wall-clock medians, 90th percentiles, the median of the paired differences, and the
median CPU time of this process per call (all its threads, the server's included: on a CPU, close to what the call
takes on an idle machine with ``--threads`` 1, whatever the machine's load).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from vla_rl.interop.serve import ServeConfig, ServerThread
from vla_rl.interop.wire import pack, unpack
from vla_rl.policies.architectures import make_policy
from vla_rl.policies.exported import CameraSpec, ExportedPolicy, ExportSpec
from vla_rl.policies.model import count_parameters
from vla_rl.policies.normalize import NormStats, Stats
from vla_rl.presets import policy_preset

WEIGHTS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build(preset: str, device: torch.device, weights: str, dtype: str) -> ExportedPolicy:
    cfg = policy_preset(preset)
    torch.manual_seed(0)
    with torch.device(device):   # initialise where the weights live (seconds for pi0 on a GPU)
        model = make_policy(cfg).eval()
    compute = {"auto": torch.bfloat16 if weights == "bf16" and device.type == "cuda" else torch.float32,
               "fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = model.to(WEIGHTS[weights]).to(compute)   # rounded to the stored dtype, then run in the compute one
    size = cfg.vision.image_size
    spec = ExportSpec(state_dim=cfg.state_dim, action_dim=cfg.action_dim, action_horizon=cfg.action_horizon,
                      execute=cfg.action_horizon, num_steps=10,
                      cameras=tuple(CameraSpec(f"camera_{i}", size, size) for i in range(cfg.num_cameras)))
    norm = NormStats(Stats.identity(cfg.state_dim), Stats.identity(cfg.action_dim))
    return ExportedPolicy(model, norm, spec, weight_dtype=weights)


class RawClient:
    """openpi's client protocol with our codec (for machines without openpi-client)."""

    def __init__(self, port: int):
        from websockets.sync.client import connect

        self.ws = connect(f"ws://127.0.0.1:{port}", compression=None, max_size=None).__enter__()
        unpack(self.ws.recv())

    def infer(self, obs: dict) -> dict:
        self.ws.send(pack(obs))
        reply = self.ws.recv()
        if isinstance(reply, str):
            raise RuntimeError(reply)
        return unpack(reply)


def paired_timings(direct, served, repeats: int) -> tuple[list[float], list[float], list[float], list[float]]:
    """Wall-clock ms of ``direct()`` and ``served()``, alternating call by call so that both see the same machine
    load (on a shared machine the load drifts more than the overhead being measured), then the CPU ms of this
    process (all its threads: the server's too) for each call, which a shared machine's load changes little."""
    for _ in range(3):
        direct(), served()
    times: tuple[list[float], ...] = ([], [], [], [])
    for _ in range(repeats):
        for fn, wall, cpu in ((direct, times[0], times[2]), (served, times[1], times[3])):
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall.append((time.perf_counter() - t0) * 1000)
            cpu.append((time.process_time() - c0) * 1000)
    return times


def measure(preset: str, device: torch.device, args, client_cls) -> tuple:
    policy = build(preset, device, args.weights, args.dtype)
    cfg, rng = policy.model.cfg, np.random.default_rng(0)
    size = args.image_size or cfg.vision.image_size
    obs = {f"camera_{i}": rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for i in range(cfg.num_cameras)}
    obs.update(state=rng.normal(size=cfg.state_dim).astype(np.float32), prompt="pick up the red cube and lift it")
    with ServerThread(policy, ServeConfig(port=0)) as server:
        client = client_cls(host="127.0.0.1", port=server.port) if client_cls else RawClient(server.port)
        assert client.infer(obs)["actions"].shape == (cfg.action_horizon, cfg.action_dim)
        direct, served, direct_cpu, served_cpu = paired_timings(lambda: policy.infer(obs), lambda: client.infer(obs),
                                                                args.repeats)
    overhead = statistics.median(s - d for d, s in zip(direct, served))
    stats = [(statistics.median(t), float(np.percentile(t, 90))) for t in (direct, served)]
    return (preset, count_parameters(policy.model) / 1e6, f"{args.weights}/{policy.compute_dtype}",
            len(pack(obs)) / 1024, *stats, overhead, statistics.median(direct_cpu), statistics.median(served_cpu))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default="tiny,small")
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--weights", choices=list(WEIGHTS), default="fp32")
    p.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto")
    p.add_argument("--image-size", type=int, default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    try:
        from openpi_client.websocket_client_policy import WebsocketClientPolicy
    except ImportError:
        WebsocketClientPolicy = None
    rows = [measure(preset, device, args, WebsocketClientPolicy) for preset in args.presets.split(",") if preset]
    client_name = "openpi-client 0.1.2" if WebsocketClientPolicy else "raw websocket client"
    print(f"\ndevice {device}{f' ({torch.cuda.get_device_name(device)})' if device.type == 'cuda' else ''}, "
          f"{args.threads} torch thread(s), K = 10, {args.repeats} calls, {client_name}\n")
    print("| preset | params | weights/compute | request | direct: median / p90 | server round trip: median / p90 "
          "| overhead: median of paired differences | CPU time, median: direct / round trip |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for preset, params, dt, kb, (dm, dp), (sm, sp), overhead, dc, sc in rows:
        print(f"| {preset} | {params:.1f}M | {dt} | {kb:.0f} KiB | {dm:.1f} / {dp:.1f} ms | {sm:.1f} / {sp:.1f} ms "
              f"| {overhead:+.1f} ms | {dc:.1f} / {sc:.1f} ms |")


if __name__ == "__main__":
    main()
