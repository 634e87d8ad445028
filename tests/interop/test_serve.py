"""``vla-rl serve``: openpi's own client (and its action-chunk broker) against our server on a loopback port, hostile
and malformed traffic, token auth, concurrency, connection limits, and clean shutdown on SIGINT / SIGTERM. Every
network call is bounded in time."""

from __future__ import annotations

import base64
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import msgpack
import numpy as np
import pytest
from exported_fixture import observation, policy_folder

pytest.importorskip("openpi_client")
import websockets  # noqa: E402
from openpi_client.action_chunk_broker import ActionChunkBroker  # noqa: E402
from openpi_client.websocket_client_policy import WebsocketClientPolicy  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

from vla_rl.interop.export import export_policy  # noqa: E402
from vla_rl.interop.serve import ServeConfig, ServerThread  # noqa: E402
from vla_rl.interop.wire import WireError, pack, unpack  # noqa: E402
from vla_rl.policies import load_exported  # noqa: E402

# openpi-client 0.1.2 opens its connection without a context manager, which websockets >= 14 warns about.
pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 30   # seconds any one network step may take (2 shared CPU cores)


def bounded(fn, timeout: float = TIMEOUT):
    """``fn()`` on a helper thread; fail the test if it does not return within ``timeout`` seconds."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the test
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        pytest.fail(f"no answer within {timeout} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    src, _, _ = policy_folder(tmp_path_factory.mktemp("src") / "policy")
    return export_policy(src, tmp_path_factory.mktemp("export") / "tiny", dtype="fp32")


@pytest.fixture(scope="module")
def policy(exported):
    return load_exported(exported)


@pytest.fixture(scope="module")
def server(policy):
    # openpi's client never closes its connection: the tests' clients stay connected, more than the default 8
    with ServerThread(policy, ServeConfig(port=0, max_connections=32, max_memory_mb=2048)) as s:
        yield s


def client(port: int, **kw) -> WebsocketClientPolicy:
    return bounded(lambda: WebsocketClientPolicy(host="127.0.0.1", port=port, **kw))


def raw(port: int):
    return bounded(lambda: connect(f"ws://127.0.0.1:{port}", compression=None, max_size=None, open_timeout=TIMEOUT))


def assert_serving(port: int, policy) -> None:
    """A fresh openpi client gets the right answer: the server survived whatever came before."""
    c = client(port)
    obs = {**observation(5), "seed": 5}
    np.testing.assert_array_equal(bounded(lambda: c.infer(obs))["actions"], policy.infer(obs))


# ----------------------------------------------------------------------------------------------------
def test_wire_roundtrip_with_openpi_codec():
    from openpi_client import msgpack_numpy

    msg = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.zeros((2, 0), np.uint8), "s": "text",
           "n": [1, 2.5, None], "d": {"x": np.int64(3)}}
    for enc, dec in [(pack, msgpack_numpy.unpackb), (msgpack_numpy.packb, unpack), (pack, unpack)]:
        out = dec(enc(msg))
        np.testing.assert_array_equal(out["a"], msg["a"])
        assert out["a"].dtype == np.float32 and out["b"].shape == (2, 0) and out["s"] == "text"
        assert out["n"] == [1, 2.5, None] and out["d"]["x"] == 3
    with pytest.raises(TypeError):
        pack({"x": np.array([object()])})


def test_openpi_client_roundtrip(server, policy):
    c = client(server.port)
    meta = c.get_server_metadata()
    assert meta["format"] == "vla-rl-export/1" and meta["action_horizon"] == 8 and meta["execute"] == 4
    assert meta["cameras"][0]["name"] == "image" and "source" not in meta   # no server file paths
    obs = {**observation(1), "seed": 11}
    first = bounded(lambda: c.infer(obs))
    second = bounded(lambda: c.infer(obs))
    assert first["actions"].shape == (8, 2) and first["actions"].dtype == np.float32
    np.testing.assert_array_equal(first["actions"], policy.infer(obs))   # the server's answer is the policy's
    np.testing.assert_array_equal(second["actions"], first["actions"])  # a seed fixes the noise
    assert first["policy_timing"]["infer_ms"] > 0 and first["server_timing"]["infer_ms"] >= \
        first["policy_timing"]["infer_ms"]
    assert "prev_total_ms" not in first["server_timing"] and second["server_timing"]["prev_total_ms"] > 0
    # openpi's LIBERO-style keys and a batch
    batch = {"observation/image": np.stack([observation(i)["image"] for i in range(3)]),
             "observation/state": np.stack([observation(i)["state"] for i in range(3)]), "prompt": "go", "seed": 2}
    assert bounded(lambda: c.infer(batch))["actions"].shape == (3, 8, 2)


def test_action_chunk_broker(server, policy):
    """openpi's broker hands out one action per call and asks the server once per ``execute`` actions."""
    execute = policy.spec.execute
    broker = ActionChunkBroker(client(server.port), action_horizon=execute)
    obs = {**observation(2), "seed": 4}
    chunk = policy.infer(obs)
    before = server.server.requests_served
    steps = [bounded(lambda: broker.infer(obs))["actions"] for _ in range(2 * execute)]
    assert server.server.requests_served - before == 2
    for i, a in enumerate(steps):
        np.testing.assert_array_equal(a, chunk[i % execute])


def _array(shape, dtype: str, data: bytes) -> dict:
    return {b"__ndarray__": True, b"data": data, b"dtype": dtype, b"shape": list(shape)}


def hostile_messages(obs: dict) -> list[tuple[str, object, str]]:
    good = pack(obs)
    return [
        ("garbage", os.urandom(64) + b"\xc1", "not a valid msgpack"),
        ("truncated", good[: len(good) // 2], "not a valid msgpack"),
        ("extra bytes", good + b"\x00", "not a valid msgpack"),
        ("text frame", "hello", "expected a binary"),
        ("deep nesting", b"\x91" * 100_000 + b"\xc0", "not a valid msgpack"),
        ("not a map", pack([1, 2, 3]), "must be a mapping"),
        ("int keys", msgpack.packb({1: 2}), "not a valid msgpack"),
        ("float image", pack({**obs, "image": obs["image"].astype(np.float32)}), "images must be uint8"),
        ("object dtype", msgpack.packb({"image": _array((1,), "|O", b"\x00" * 8)}), "dtype '|O' is not accepted"),
        ("short data", msgpack.packb({"image": _array((1000, 1000, 3), "|u1", b"\x00" * 10)}), "needs 3000000 bytes"),
        ("huge shape", msgpack.packb({"image": _array((2**40, 2**40), "|u1", b"")}), "needs"),
        ("bad shape", msgpack.packb({"image": _array((-1,), "|u1", b"")}), "non-negative ints"),
        ("huge image", pack({**obs, "image": np.zeros((2100, 2100, 3), np.uint8)}), "each side must be in"),
        ("wrong state", pack({**obs, "state": np.zeros(5, np.float32)}), "state must have shape"),
        ("string state", pack({**obs, "state": "1,2,3,4"}), "expected an array, got str"),
        ("bool state", pack({**obs, "state": np.zeros(4, bool)}), "state must be numbers"),
        ("unknown key", pack({**obs, "wrist_image": obs["image"]}), "unknown observation key"),
        ("too big a batch", pack({"image": np.zeros((65, 32, 32, 3), np.uint8), "state": np.zeros((65, 4)),
                                  "prompt": "go"}), "at most 64"),
        ("bad scalar", msgpack.packb({**{k: v for k, v in obs.items() if k not in ("image", "state")},
                                      "seed": {b"__npgeneric__": True, b"data": 300, b"dtype": "|u1"}}),
         "does not fit"),
    ]


def test_hostile_messages_get_error_replies_and_the_connection_lives_on(server, policy):
    obs = observation(3)
    with raw(server.port) as ws:
        unpack(bounded(lambda: ws.recv(timeout=TIMEOUT)))   # the metadata
        for name, message, expected in hostile_messages(obs):
            bounded(lambda m=message: ws.send(m))
            reply = bounded(lambda: ws.recv(timeout=TIMEOUT))
            assert isinstance(reply, str) and expected in reply, (name, reply)
        bounded(lambda: ws.send(pack({**obs, "seed": 9})))   # a good request on the same connection still works
        np.testing.assert_array_equal(unpack(bounded(lambda: ws.recv(timeout=TIMEOUT)))["actions"],
                                      policy.infer({**obs, "seed": 9}))
    # openpi's client turns an error reply into RuntimeError, and may go on
    c = client(server.port)
    with pytest.raises(RuntimeError, match="state must have shape"):
        bounded(lambda: c.infer({**obs, "state": np.zeros(3)}))
    assert bounded(lambda: c.infer(obs))["actions"].shape == (8, 2)


def test_wire_refuses_bad_arrays_directly():
    for data, match in [(msgpack.packb(_array((2,), "<f4", b"\x00" * 7)), "needs 8 bytes"),
                        (msgpack.packb(_array((2,), "<U1", b"\x00" * 8)), "not accepted"),
                        (msgpack.packb({b"__ndarray__": True, b"data": b""}), "exactly the keys"),
                        (b"", "not a valid msgpack")]:
        with pytest.raises(WireError, match=match):
            unpack(data)


def _handshake(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    key = base64.b64encode(os.urandom(16)).decode()
    s.sendall(f"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
              f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = s.recv(4096)
        assert chunk, "connection closed during the handshake"
        head += chunk
    assert head.startswith(b"HTTP/1.1 101"), head[:80]
    return s


def test_disconnects_mid_message_and_non_websocket_traffic(server, policy):
    # A binary frame that announces 1 MB, sends 1 kB of it, and hangs up.
    s = _handshake(server.port)
    s.sendall(b"\x82\xff" + (1_000_000).to_bytes(8, "big") + os.urandom(4) + os.urandom(1000))
    s.close()
    # A fragmented message cut off after its first fragment.
    s = _handshake(server.port)
    s.sendall(b"\x02\x85" + os.urandom(4) + os.urandom(5))   # opcode binary, FIN clear: more fragments to come
    s.close()
    # Not HTTP at all, then an HTTP request that is not a websocket upgrade.
    s = socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT)
    s.sendall(os.urandom(256) + b"\r\n\r\n")
    s.close()
    with pytest.raises(urllib.error.HTTPError):
        bounded(lambda: urllib.request.urlopen(f"http://127.0.0.1:{server.port}/", timeout=TIMEOUT))
    assert_serving(server.port, policy)


def test_oversized_messages_close_the_connection(policy):
    with ServerThread(policy, ServeConfig(port=0, max_message_mb=0.05)) as s:
        with raw(s.port) as ws:
            unpack(bounded(lambda: ws.recv(timeout=TIMEOUT)))
            bounded(lambda: ws.send(pack({"image": np.zeros((200, 200, 3), np.uint8)})))   # 120 kB > 51 kB
            with pytest.raises(websockets.exceptions.ConnectionClosed) as info:
                bounded(lambda: ws.recv(timeout=TIMEOUT))
        assert info.value.rcvd is not None and info.value.rcvd.code == 1009   # "message too big"
        assert_serving(s.port, policy)


def test_token_auth(policy):
    with ServerThread(policy, ServeConfig(port=0, token="s3cret-token")) as s:
        for key in (None, "wrong"):
            with pytest.raises(websockets.exceptions.InvalidStatus) as info:
                client(s.port, api_key=key)
            assert info.value.response.status_code == 401
        c = client(s.port, api_key="s3cret-token")
        assert bounded(lambda: c.infer(observation(0)))["actions"].shape == (8, 2)
        health = bounded(lambda: urllib.request.urlopen(f"http://127.0.0.1:{s.port}/healthz", timeout=TIMEOUT))
        assert health.status == 200 and health.read() == b"OK\n"


def test_connection_limit(policy):
    with ServerThread(policy, ServeConfig(port=0, max_connections=1)) as s:
        first = client(s.port)
        with pytest.raises(websockets.exceptions.InvalidStatus) as info:
            client(s.port)
        assert info.value.response.status_code == 503
        assert bounded(lambda: first.infer(observation(0)))["actions"].shape == (8, 2)


def test_concurrent_clients(server, policy):
    seeds = {t: [100 * t + i for i in range(3)] for t in range(4)}
    want = {seed: policy.infer({**observation(seed), "seed": seed}) for s in seeds.values() for seed in s}
    got: dict = {}

    def work(t):
        c = WebsocketClientPolicy(host="127.0.0.1", port=server.port)
        for seed in seeds[t]:
            got[seed] = c.infer({**observation(seed), "seed": seed})["actions"]

    threads = [threading.Thread(target=work, args=(t,), daemon=True) for t in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * TIMEOUT)
    assert not any(t.is_alive() for t in threads), "clients did not finish"
    assert sorted(got) == sorted(want)
    for seed in want:
        np.testing.assert_array_equal(got[seed], want[seed])


def test_cli_serve_errors(exported, server, tmp_path, capsys):
    from vla_rl.cli import main

    assert main(["serve", str(tmp_path / "missing"), "--port", "0"]) == 2
    assert "no exported policy folder" in capsys.readouterr().err
    assert main(["serve", str(exported), "--port", str(server.port)]) == 2   # the port is taken
    assert "cannot serve" in capsys.readouterr().err
    assert main(["serve", str(exported), "--port", "70000"]) == 2
    assert "port = 70000 is outside its valid range" in capsys.readouterr().err


@pytest.mark.parametrize("sig", [signal.SIGINT])   # SIGTERM: the test of a robot's minimal install below
def test_cli_serve_stops_cleanly_on_signals(exported, policy, sig):
    proc = subprocess.Popen([sys.executable, "-m", "vla_rl.cli", "serve", str(exported), "--port", "0"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    try:
        port = None
        while port is None:
            line = lines.get(timeout=120)   # start-up imports torch: slow on a busy machine
            m = re.search(r"serving .* on ws://127\.0\.0\.1:(\d+)", line)
            port = int(m.group(1)) if m else None
        assert_serving(port, policy)
        proc.send_signal(sig)
        assert proc.wait(timeout=TIMEOUT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    rest = []
    while not lines.empty():
        rest.append(lines.get())
    assert any("stopped after 1 requests" in line for line in rest), rest
    with pytest.raises(OSError):   # the port is closed
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


# ------------------------------------------------------------------------------------- a robot's minimal install
# Run first in a server process: the `train` extra's packages (and Pillow, which imageio and matplotlib pull in)
# cannot be imported there, as on a robot that installed only `vla-rl[serve]`.
# (None in sys.modules: `import X` fails and importlib.util.find_spec("X") is None, as for a missing package.)
BLOCK_TRAINING = """
import sys
from vla_rl.cli import TRAIN_PACKAGES
for name in [*TRAIN_PACKAGES, "PIL"]:
    assert name not in sys.modules, name
    sys.modules[name] = None
"""


def serve_in_subprocess(exported, prelude: str = "", python: str = sys.executable, cwd=ROOT, env=None):
    """``vla-rl serve EXPORT --port 0`` in a process of ``python`` that first runs ``prelude``; returns the
    process, its port and its output lines (a queue, from the first)."""
    script = prelude + ("import sys\nfrom vla_rl.cli import main\n"
                        f"sys.exit(main(['serve', {str(exported)!r}, '--port', '0']))\n")
    proc = subprocess.Popen([python, "-c", script], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    seen, waited = [], 0
    while True:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            waited += 1   # start-up imports torch: slow on a busy machine
            if proc.poll() is not None or waited > 120:
                proc.kill()
                pytest.fail(f"the server did not start: {''.join(seen)}")
            continue
        seen.append(line)
        if m := re.search(r"serving .* on ws://127\.0\.0\.1:(\d+)", line):
            for earlier in seen:   # handed back with the rest
                lines.put(earlier)
            return proc, int(m.group(1)), lines


def stop_server(proc, lines) -> list[str]:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=TIMEOUT) == 0
    rest = []
    while not lines.empty():
        rest.append(lines.get())
    return rest


def test_exported_policy_and_server_run_without_the_training_packages(exported, policy):
    """load_exported().infer and `vla-rl serve` with none of the `train` extra importable: the answers are the
    ones the full install gives, and the server stops cleanly on SIGTERM."""
    obs = {**observation(5), "seed": 5}
    probe = BLOCK_TRAINING + (
        "import numpy as np\nfrom vla_rl.policies import load_exported\n"
        f"obs = {{'image': np.frombuffer({obs['image'].tobytes()!r}, np.uint8).reshape({obs['image'].shape}), "
        f"'state': np.frombuffer({obs['state'].tobytes()!r}, np.float32), 'prompt': {obs['prompt']!r}, 'seed': 5}}\n"
        f"print('actions', load_exported({str(exported)!r}).infer(obs).tobytes().hex())\n")
    proc, port, lines = serve_in_subprocess(exported, probe)
    try:
        assert_serving(port, policy)
    finally:
        if proc.poll() is None:
            rest = stop_server(proc, lines)
    printed = [x for x in rest if x.startswith("actions ")]
    assert any("stopped after 1 requests" in x for x in rest), rest
    assert bytes.fromhex(printed[-1].split()[1]) == np.asarray(policy.infer(obs)).tobytes()
    with pytest.raises(OSError):   # the port is closed
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_train_extra_matches_pyproject_and_its_absence_is_one_line(tmp_path, monkeypatch, capsys):
    import importlib.util

    tomllib = pytest.importorskip("tomllib")
    from vla_rl.cli import TRAIN_PACKAGES, main

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=!\[ ]", r)[0] for r in project["optional-dependencies"]["train"]}
    assert names == set(TRAIN_PACKAGES.values())
    base = {re.split(r"[<>=!\[ ]", r)[0] for r in project["dependencies"]}
    assert base == {"torch", "numpy", "safetensors", "pyyaml"}   # a robot's install: nothing for training

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("tensorboard", "av")
                        else real(name, *a))
    assert main(["train", "builtin_flow_sde", f"out={tmp_path / 'run'}"]) == 2
    assert capsys.readouterr().err.strip() == ("vla-rl: install error: `vla-rl train` needs the training packages, "
                                               "and tensorboard, av are not installed: pip install 'vla-rl[train]'")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow   # a fresh virtual environment: torch and the base install (minutes, and the package index)
def test_a_clean_venv_with_only_the_serve_extra_serves_an_exported_policy(tmp_path, exported, policy):
    """`pip install 'vla-rl[serve]'` into a new virtual environment (torch installed first, as the README says)
    installs none of the `train` extra, and its `vla-rl serve`, run outside the checkout, answers as ours."""
    from vla_rl.cli import TRAIN_PACKAGES

    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "wheel")], check=True, capture_output=True)
    (wheel,) = (tmp_path / "wheel").glob("vla_rl-*.whl")
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "venv")], check=True)
    py = str(tmp_path / "venv" / "bin" / "python")
    torch_version = __import__("torch").__version__.split("+")[0]
    got = subprocess.run([py, "-m", "pip", "install", "-q", f"torch=={torch_version}", "--extra-index-url",
                          "https://download.pytorch.org/whl/cpu"], capture_output=True, text=True)
    if got.returncode:
        pytest.skip(f"torch {torch_version} could not be installed into a new venv: {got.stderr.strip()[-300:]}")
    subprocess.run([py, "-m", "pip", "install", "-q", f"{wheel}[serve]"], check=True, capture_output=True)
    listed = subprocess.run([py, "-m", "pip", "list", "--format=freeze"], check=True, capture_output=True,
                            text=True).stdout
    installed = {re.split(r"==", x)[0].lower().replace("_", "-") for x in listed.split()}
    assert not installed & {*TRAIN_PACKAGES.values(), "pillow", "protobuf", "grpcio"}, sorted(installed)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc, port, lines = serve_in_subprocess(exported, python=py, cwd=tmp_path, env=env)
    try:
        assert_serving(port, policy)
    finally:
        if proc.poll() is None:
            rest = stop_server(proc, lines)
    assert any("stopped after 1 requests" in x for x in rest), rest


def test_a_huge_but_finite_state_is_an_invalid_request_naming_the_field(server, policy):
    """1e38 is a finite float32, but normalised and squared inside the model it overflows: it is refused where
    it leaves the range, naming the value, and the server goes on serving."""
    from vla_rl.policies import ObservationError

    huge = {**observation(0), "state": np.array([0.1, 1e38, 0.0, 0.2], np.float32)}
    with pytest.raises(ObservationError, match=r"state\[1\] = 1e\+38 is .* normalised units"):
        policy.infer(huge)
    batch = {"image": np.stack([observation(0)["image"]] * 2), "prompt": "go",
             "state": np.array([[0.0] * 4, [0.0, 0.0, -3e37, 0.0]], np.float32)}
    with pytest.raises(ObservationError, match=r"state\[1, 2\] = -3e\+37"):
        policy.infer(batch)
    assert np.isfinite(policy.infer({**observation(0), "state": np.full(4, 1e3, np.float32)})).all()
    with raw(server.port) as ws:
        unpack(bounded(lambda: ws.recv(timeout=TIMEOUT)))
        bounded(lambda: ws.send(pack(huge)))
        reply = bounded(lambda: ws.recv(timeout=TIMEOUT))
        assert isinstance(reply, str) and reply.startswith("invalid request: state[1] = 1e+38"), reply
    assert_serving(server.port, policy)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_serve_on_cuda_without_cuda_is_a_config_error(exported, capsys):
    from vla_rl.cli import main

    assert main(["serve", str(exported), "--port", "0", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    # the advice is spelled as serve takes it (--device cpu), not as a config key
    assert err.startswith("vla-rl: config error: --device cuda, but CUDA is not available"), err
    assert err.rstrip().endswith("use --device cpu"), err


def test_limits_that_let_messages_outgrow_the_memory_budget_are_refused(exported, capsys):
    from vla_rl.cli import main
    from vla_rl.core.ranges import ConfigError

    default = ServeConfig()
    assert default.message_memory_mb <= default.max_memory_mb
    assert ServeConfig(max_connections=2, max_message_mb=8).message_memory_mb == (3 * 2 + 16) * 8
    with pytest.raises(ConfigError, match="max_memory_mb"):
        ServeConfig(max_connections=64)
    assert main(["serve", str(exported), "--port", "0", "--max-connections", "64"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vla-rl: config error: max_connections = 64 and max_message_mb = 16") and \
        "--max" not in err.split("lower")[0], err


def test_server_memory_under_many_large_messages_stays_within_its_bound():
    """Six clients each send two 3.9 MB observations at once to a server whose every inference takes 100 ms
    (so requests pile up): its resident memory grows by less than the bound it checks at start."""
    script = ROOT / "benchmarks" / "bench_serve_memory.py"
    args = ["--clients", "6", "--message-mb", "3.9", "--rounds", "2", "--infer-ms", "100", "--",
            "--max-message-mb", "4", "--max-connections", "6"]
    out = subprocess.run([sys.executable, str(script), *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    row = out.stdout.strip().splitlines()[-1].split("|")
    served, growth = row[2].strip(), float(row[-2])
    assert served == "6 / 0", out.stdout
    bound = ServeConfig(max_message_mb=4, max_connections=6).message_memory_mb
    assert 0 < growth <= bound, (growth, bound)


def test_a_smolvla_export_is_served(tmp_path):
    """The server knows no architecture: a SmolVLA export answers an openpi client as the policy itself does."""
    src, _, _ = policy_folder(tmp_path / "policy", preset="tiny_smolvla")
    smol = load_exported(export_policy(src, tmp_path / "export", dtype="fp32"))
    with ServerThread(smol, ServeConfig(port=0)) as s:
        c = client(s.port)
        obs = {**observation(3), "seed": 3}
        np.testing.assert_array_equal(bounded(lambda: c.infer(obs))["actions"], smol.infer(obs))
