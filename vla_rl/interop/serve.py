"""``vla-rl serve``: an exported policy behind a websocket server that speaks openpi's protocol.

The protocol (what ``openpi_client.websocket_client_policy.WebsocketClientPolicy`` 0.1.2 expects):
- on connect the server sends the policy's metadata, one binary msgpack message;
- then each binary message from the client is an observation (msgpack, arrays as in :mod:`.wire`), answered by
  one binary message ``{"actions": [H, a] float32, "policy_timing": {"infer_ms"}, "server_timing": {"infer_ms",
  "prev_total_ms"}}`` (``prev_total_ms``: the previous request's receive-to-send time, from the second on);
- an error is answered by a text message (the client raises it as ``RuntimeError``); this server keeps the
  connection open after a bad request, so the client may send a corrected one;
- a client authenticates, when the server has a token, with the HTTP header ``Authorization: Api-Key <token>``
  (openpi-client's ``api_key``); ``GET /healthz`` answers ``OK`` without one.

Security defaults: binds 127.0.0.1; messages over ``max_message_mb`` close the connection (code 1009); no
compression (no decompression bombs); at most ``max_connections`` clients; every observation is validated
(:func:`vla_rl.policies.exported.parse_observation`) before it reaches the model. Inference runs on one worker
thread, so concurrent clients are served in turn while the event loop keeps accepting, validating and answering
errors.

Memory: a connection holds the message it is serving and at most one more (``max_queue=0``: reading stops while a
received frame waits; websockets' read buffer keeps about one message's size more), at most :data:`DECODE_SLOTS`
requests are decoded at a time (decoding copies a message's arrays once, the model's input once more), and one
is inferred at a time (resizing its images works in float32: four bytes a value). So messages take at most
:meth:`ServeConfig.message_memory_mb`, which must fit ``max_memory_mb`` (``benchmarks/bench_serve_memory.py``
measures it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, replace
from http import HTTPStatus
from typing import Literal

import torch

from vla_rl.core.ranges import ConfigError, check_ranges, positive, ranged
from vla_rl.policies.exported import ExportedPolicy, ObservationError, load_exported
from vla_rl.presets import resolve_device

from .wire import WireError, pack, unpack

log = logging.getLogger("vla_rl.serve")
TOKEN_ENV = "VLA_RL_SERVE_TOKEN"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
DECODE_SLOTS = 2   # requests decoded at once: one being inferred, one ready (inference runs one at a time)


@dataclass(frozen=True)
class ServeConfig:
    """Server settings (``vla-rl serve`` flags)."""

    host: str = "127.0.0.1"
    port: int = ranged(8000, 0, 65535)          # 0: any free port (the bound one is printed)
    token: str | None = None                    # shared secret; None: no authentication
    max_message_mb: float = positive(16.0)      # largest observation message accepted
    max_connections: int = positive(8)
    # The most memory messages may take (message_memory_mb, from the two above), checked at start.
    max_memory_mb: float = positive(1024.0)
    max_batch: int = positive(64)               # observations per request
    device: str = "cpu"
    dtype: Literal["auto", "fp32", "bf16"] = "auto"
    compile: Literal["none", "compile", "cudagraph"] = "none"   # how the denoising loop runs (docs/speed.md)

    def __post_init__(self):
        check_ranges(self)
        if self.token is not None and (not self.token or not self.token.isprintable() or not self.token.isascii()):
            raise ConfigError("token must be a non-empty printable ASCII string")
        if self.message_memory_mb > self.max_memory_mb:
            raise ConfigError(
                f"max_connections = {self.max_connections} and max_message_mb = {self.max_message_mb:g} let messages "
                f"take up to {self.message_memory_mb:g} MB, more than max_memory_mb = {self.max_memory_mb:g}: lower "
                "one of the first two or raise max_memory_mb (docs/deploy.md#memory)")

    @property
    def max_message_bytes(self) -> int:
        return int(self.max_message_mb * 2**20)

    @property
    def message_memory_mb(self) -> float:
        """The most memory messages can take: three message sizes per connection (the message being served, one
        received after it, websockets' read buffer) and sixteen for the requests being decoded and inferred (two
        decoded copies for each of the :data:`DECODE_SLOTS`, and the float32 resize of one request's images).
        Measured below it: 8 clients each sending four 3.9 MB messages at once to a server that takes 300 ms an
        inference peaked 132 MB above idle, against (3 x 8 + 16) x 4 = 160 (``benchmarks/bench_serve_memory.py``)."""
        return (3 * self.max_connections + 16) * self.max_message_mb


class PolicyServer:
    """Serves ``policy`` (an :class:`ExportedPolicy`) with ``cfg``; :meth:`serve` runs until ``stop`` is set."""

    def __init__(self, policy: ExportedPolicy, cfg: ServeConfig):
        self.policy, self.cfg = policy, cfg
        self.metadata = {k: v for k, v in policy.metadata().items() if k != "source"}   # no server paths
        self.port: int | None = None
        self._connections = 0
        self._requests = 0
        self._decoding = asyncio.Semaphore(DECODE_SLOTS)
        # torch's intra-op thread count is per thread: the worker takes the process's (e.g. torch.set_num_threads).
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="vla-rl-infer", initializer=torch.set_num_threads,
            initargs=(torch.get_num_threads(),))

    # -- handshake ---------------------------------------------------------------------------------------
    def _process_request(self, connection, request):
        if request.path == "/healthz":
            return connection.respond(HTTPStatus.OK, "OK\n")
        if self._connections >= self.cfg.max_connections:
            return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE, "too many clients\n")
        if self.cfg.token is not None:
            got = request.headers.get("Authorization", "")
            want = f"Api-Key {self.cfg.token}"
            if not hmac.compare_digest(got.encode("utf-8", "replace"), want.encode()):
                log.warning("refused a client without the right token from %s", connection.remote_address)
                return connection.respond(HTTPStatus.UNAUTHORIZED, "missing or wrong api key\n")
        return None

    # -- one connection ----------------------------------------------------------------------------------
    def _check(self, message) -> object:
        if isinstance(message, str):
            raise WireError("expected a binary msgpack message, got text")
        obs = unpack(message)
        batch = self.policy.parse(obs)
        if batch.size > self.cfg.max_batch:
            raise ObservationError(f"{batch.size} observations in one request; at most {self.cfg.max_batch}")
        return batch

    def _infer(self, batch) -> tuple[object, float]:
        t = time.monotonic()
        actions = self.policy.run(batch)
        return actions, (time.monotonic() - t) * 1000

    async def _handler(self, ws) -> None:
        from websockets.exceptions import ConnectionClosed

        self._connections += 1
        peer = ws.remote_address
        log.info("client %s connected (%d open)", peer, self._connections)
        loop = asyncio.get_running_loop()
        prev_total_ms = None
        try:
            await ws.send(pack(self.metadata))
            async for message in ws:
                start = time.monotonic()
                try:
                    async with self._decoding:   # bounds the decoded copies (see the module docstring)
                        batch = self._check(message)
                        actions, policy_ms = await loop.run_in_executor(self._executor, self._infer, batch)
                        del batch
                except (WireError, ObservationError) as e:
                    await ws.send(f"invalid request: {e}")
                    continue
                except Exception as e:   # the model failed (e.g. out of memory): tell this client, serve the rest
                    log.exception("inference failed for %s", peer)
                    await ws.send(f"internal error: {type(e).__name__}: {e}")
                    continue
                reply = {"actions": actions, "policy_timing": {"infer_ms": policy_ms},
                         "server_timing": {"infer_ms": (time.monotonic() - start) * 1000}}
                if prev_total_ms is not None:
                    reply["server_timing"]["prev_total_ms"] = prev_total_ms
                self._requests += 1   # counted before the reply leaves: a client that has it sees it counted
                await ws.send(pack(reply))
                prev_total_ms = (time.monotonic() - start) * 1000
                del message   # not held while waiting for the next one
        except ConnectionClosed as e:
            log.info("client %s gone: %s", peer, e)
        finally:
            self._connections -= 1

    # -- the server --------------------------------------------------------------------------------------
    async def serve(self, stop: asyncio.Event, ready: threading.Event | None = None) -> None:
        """Serve until ``stop`` is set; then close every connection (code 1001) and return."""
        from websockets.asyncio.server import serve

        async with serve(self._handler, self.cfg.host, self.cfg.port, process_request=self._process_request,
                         max_size=self.cfg.max_message_bytes, max_queue=0, compression=None,
                         open_timeout=10, close_timeout=5, ping_interval=20, ping_timeout=20) as server:
            self.port = next(iter(server.sockets)).getsockname()[1]
            if ready is not None:
                ready.set()
            await stop.wait()
        self._executor.shutdown(wait=True)

    @property
    def requests_served(self) -> int:
        return self._requests


class ServerThread:
    """A :class:`PolicyServer` on a background thread with its own event loop (tests, benchmarks, notebooks):
    ``with ServerThread(policy, cfg) as s: ... s.port ...``."""

    def __init__(self, policy: ExportedPolicy, cfg: ServeConfig | None = None):
        self.server = PolicyServer(policy, cfg or ServeConfig(port=0))
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="vla-rl-serve", daemon=True)

    def _run(self) -> None:
        async def main():
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            await self.server.serve(self._stop, self._ready)

        try:
            asyncio.run(main())
        except BaseException as e:   # e.g. the port is taken: reported by start()
            self._error = e
            self._ready.set()

    @property
    def port(self) -> int:
        return self.server.port

    def start(self, timeout: float = 30) -> ServerThread:
        self._thread.start()
        if not self._ready.wait(timeout) or self._error is not None:
            raise RuntimeError(f"the policy server did not start: {self._error!r}")
        return self

    def stop(self, timeout: float = 30) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def run_server(path: str, cfg: ServeConfig) -> int:
    """``vla-rl serve``: load the export at ``path`` and serve it until SIGINT / SIGTERM (then exit 0)."""
    token = cfg.token if cfg.token is not None else os.environ.get(TOKEN_ENV) or None
    if token != cfg.token:
        cfg = replace(cfg, token=token)
    # `--device cuda` without CUDA: a config error, as for training (advising `--device cpu`, as serve spells it)
    device = resolve_device(cfg.device, spelled="--device {}")
    policy = load_exported(path, device=device, dtype=cfg.dtype, compile=cfg.compile)
    if cfg.host not in LOOPBACK and cfg.token is None:
        log.warning("serving on %s without a token: anyone who can reach this port can drive the policy "
                    "(set --token or %s)", cfg.host, TOKEN_ENV)
    server = PolicyServer(policy, cfg)

    async def main():
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        ready = threading.Event()
        task = asyncio.create_task(server.serve(stop, ready))
        while not ready.is_set() and not task.done():
            await asyncio.sleep(0.01)
        if task.done():
            await task   # raises the start-up error (e.g. the port is taken)
        spec = policy.spec
        print(f"serving {path} on ws://{cfg.host}:{server.port} ({'token required' if cfg.token else 'no token'}; "
              f"H={spec.action_horizon}, execute {spec.execute}, K={spec.num_steps}, {policy.compute_dtype} on "
              f"{policy.device})", flush=True)
        await task

    asyncio.run(main())
    print(f"stopped after {server.requests_served} requests", flush=True)
    return 0
