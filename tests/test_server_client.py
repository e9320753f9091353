"""The parts of ``generation.backend=vllm_server`` that need no vLLM (main venv, CPU suite).

Request building, answer parsing, load balancing, config validation, the gloo broadcast both
ends use, and the launcher's process handling. Where a server must answer, a small fake HTTP
server stands in for vLLM (this venv has no vLLM; tests/test_vllm_server.py runs the real one).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch

from mars2.generation.config import GenerationConfig
from mars2.generation.vllm_server import (
    Endpoints,
    LaunchedServer,
    VLLMServerGenerator,
    _flags,
    check_server_config,
    completion_request,
    parse_completion,
    write_plugin_shim,
)
from mars2.generation.weight_transfer import (
    ServerError,
    broadcast,
    chunks,
    free_port,
    open_group,
)


def test_config_refuses_unknown_keys_mixed_modes_and_unknown_backends() -> None:
    with pytest.raises(ValueError, match=r"unknown generation\.server keys"):
        check_server_config("a", {"url": "http://x"})
    with pytest.raises(ValueError, match="choose one"):
        check_server_config("a", {"urls": ["http://x"], "venv": ".venv-vllm"})
    with pytest.raises(ValueError, match="weight_transfer"):
        check_server_config("a", {"weight_transfer": "rdma"})
    with pytest.raises(ValueError, match="is empty"):
        check_server_config("a", {"urls": []})
    assert check_server_config("a", {"urls": "http://x"})["urls"] == ["http://x"]
    assert check_server_config("a", {})["weight_transfer"] == "gloo"  # no CUDA here
    with pytest.raises(ValueError, match="backend=vllm_server"):
        GenerationConfig(backend="vllm", server={"urls": ["http://x"]})


def test_flags_and_request_body() -> None:
    assert _flags({"max_model_len": 512, "enforce-eager": True, "x": False,
                   "weight-transfer-config": {"backend": "gloo"}}) == [
        "--max-model-len", "512", "--enforce-eager",
        "--weight-transfer-config", '{"backend": "gloo"}',
    ]  # fmt: skip
    config = GenerationConfig(backend="vllm_server", max_new_tokens=7, temperature=0.8, top_p=0.9)
    body = completion_request("m", [1, 2, 3], config, seed=5)
    assert body == {"model": "m", "prompt": [1, 2, 3], "max_tokens": 7, "temperature": 0.8,
                    "top_p": 0.9, "logprobs": 0, "return_token_ids": True, "n": 1,
                    "seed": 5}  # fmt: skip


def test_parse_completion_keeps_token_ids_and_logprobs() -> None:
    answer = {"choices": [{"text": "ab", "token_ids": [5, 6], "finish_reason": "length",
                           "logprobs": {"token_logprobs": [-0.5, -1.0]}}]}  # fmt: skip
    c = parse_completion([1, 2], answer)
    assert (c.token_ids, c.logprobs, c.truncated, c.prompt_token_ids) == (
        [5, 6], [-0.5, -1.0], True, [1, 2])  # fmt: skip
    with pytest.raises(ServerError, match="return_token_ids"):
        parse_completion([1], {"choices": [{"text": "x"}]})


def test_endpoints_send_each_request_to_the_least_busy_server() -> None:
    ends = Endpoints(["http://a/", "http://b", "http://c"])
    first = [ends.acquire() for _ in range(3)]
    assert sorted(first) == ["http://a", "http://b", "http://c"]
    ends.release("http://b")
    assert ends.acquire() == "http://b"  # the only one with a free slot
    assert ends.in_flight() == 3


def test_chunks_split_by_bytes_and_keep_order() -> None:
    weights = [(str(i), torch.zeros(256)) for i in range(5)]  # 1 KiB each
    split = list(chunks(weights, limit=2048))
    assert [[n for n, _ in c] for c in split] == [["0", "1"], ["2", "3"], ["4"]]


def test_gloo_group_broadcasts_from_the_trainer() -> None:
    port = free_port()
    got: list[torch.Tensor] = []

    def worker() -> None:
        group = open_group("127.0.0.1", port, 1, 2, 30)
        t = torch.empty(4)
        broadcast(group, t)
        got.append(t)

    thread = threading.Thread(target=worker)
    thread.start()
    group = open_group("127.0.0.1", port, 0, 2, 30)
    broadcast(group, torch.arange(4.0))
    thread.join(30)
    assert got and torch.equal(got[0], torch.arange(4.0))


def test_plugin_shim_declares_the_vllm_entry_point(tmp_path: Path) -> None:
    from importlib.metadata import distributions

    write_plugin_shim(tmp_path)
    (dist,) = distributions(path=[str(tmp_path)])
    (entry,) = dist.entry_points
    assert (entry.group, entry.value) == (
        "vllm.general_plugins",
        "mars2.generation.vllm_plugin:register",
    )


class _Fake(BaseHTTPRequestHandler):
    """A stand-in for vLLM's /v1/completions: echoes the prompt's last token plus one."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/v1/completions":
            self.server.seen.append(self.server.server_port)  # type: ignore[attr-defined]
            tokens = [body["prompt"][-1] + 1] * body["max_tokens"]
            out = {"choices": [{"text": "x", "token_ids": tokens, "finish_reason": "length",
                                "logprobs": {"token_logprobs": [-0.1] * len(tokens)}}]}  # fmt: skip
            data = json.dumps(out).encode()
            self.send_response(200)
        else:
            data = b'{"detail": "no"}'
            self.send_response(500)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


class _Tok:
    def apply_chat_template(self, chat: Any, **kw: Any) -> list[int]:
        return [len(chat[0]["content"])]


def test_generator_spreads_a_steps_requests_over_its_servers_and_streams_them() -> None:
    servers = []
    for _ in range(2):
        s = ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
        s.seen = []  # type: ignore[attr-defined]
        threading.Thread(target=s.serve_forever, daemon=True).start()
        servers.append(s)
    urls = [f"http://127.0.0.1:{s.server_port}" for s in servers]
    config = GenerationConfig(backend="vllm_server", max_new_tokens=3)
    gen = VLLMServerGenerator("a", _Tok(), config, urls, check_server_config("a", {"urls": urls}))
    try:
        chats = [[{"role": "user", "content": "x" * n}] for n in range(1, 9)]
        out = gen.generate(chats)
        assert [c.token_ids for c in out] == [[n + 1] * 3 for n in range(1, 9)]
        assert all(s.seen for s in servers)  # type: ignore[attr-defined]
        done: dict[int, Any] = {}
        event = threading.Event()

        def report(i: int, c: Any) -> None:
            done[i] = c
            if len(done) == 8:
                event.set()

        gen.submit(chats, report)
        assert event.wait(30)
        assert [done[i].token_ids[0] for i in range(8)] == list(range(2, 10))
        with pytest.raises(ServerError, match=r"weight sync to .* failed") as err:
            gen.sync_weights(None)  # the fake answers 500 to /pause: the sync fails loudly
        assert "answered 500" in str(err.value)
    finally:
        gen.close()
        for s in servers:
            s.shutdown()


def test_server_generator_marks_prompts_cut_to_the_cap(tiny_models_dir: Path) -> None:
    """Blocking and streamed requests both carry `Completion.prompt_cut` (the step's count)."""
    from mars2.generation.prompt import CUTTABLE
    from mars2.models.loading import load_tokenizer

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
    server.seen = []  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    urls = [f"http://127.0.0.1:{server.server_port}"]
    config = GenerationConfig(backend="vllm_server", max_new_tokens=2, max_prompt_tokens=400)
    tokenizer = load_tokenizer(str(tiny_models_dir / "tiny_qwen3"))
    gen = VLLMServerGenerator(
        "a", tokenizer, config, urls, check_server_config("a", {"urls": urls})
    )
    code = "".join(f"y{i} = {i}\n" for i in range(300))
    chats = [[{"role": "user", "content": f"Fix:\n{code}", CUTTABLE: code}],
             [{"role": "user", "content": "Write a program."}]]  # fmt: skip
    try:
        cut, whole = gen.generate(chats)
        assert cut.prompt_cut and len(cut.prompt_token_ids) <= 400 and not whole.prompt_cut
        done: dict[int, Any] = {}
        event = threading.Event()

        def report(i: int, c: Any) -> None:
            done[i] = c
            if len(done) == 2:
                event.set()

        gen.submit(chats, report)
        assert event.wait(30)
        assert done[0].prompt_cut and not done[1].prompt_cut
    finally:
        gen.close()
        server.shutdown()


FAKE_SERVER = textwrap.dedent("""
    import os, subprocess, sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer
    port = int(sys.argv[sys.argv.index("--port") + 1])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(os.environ["FAKE_PIDS"], "w").write(f"{os.getpid()} {child.pid}")
    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    HTTPServer(("127.0.0.1", port), H).serve_forever()
""")

TRAINER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from mars2.generation.vllm_server import LaunchedServer
    from mars2.generation.weight_transfer import free_port
    port = free_port()
    s = LaunchedServer([sys.executable, sys.argv[1], "--port", str(port)], dict(__import__("os").environ),
                       Path(sys.argv[2]), f"http://127.0.0.1:{port}")
    s.wait_healthy(60)
    print("healthy", flush=True)
    time.sleep(600)
""")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    status = (
        Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}").exists() else "X"
    )
    return status == "Z"


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGINT])
def test_no_server_process_outlives_a_killed_trainer(tmp_path: Path, how: int) -> None:
    """The launcher's guarantees with a fake server standing in for vLLM (a process with a child
    of its own, like vLLM's engine core): the trainer dies by `kill -9` or Ctrl-C and nothing of
    the server's process group is left."""
    fake, trainer, pids = tmp_path / "fake.py", tmp_path / "trainer.py", tmp_path / "pids"
    fake.write_text(FAKE_SERVER + "\n")
    trainer.write_text(TRAINER)
    env = {**os.environ, "FAKE_PIDS": str(pids)}
    proc = subprocess.Popen([sys.executable, str(trainer), str(fake), str(tmp_path / "log")],
                            env=env, stdout=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "healthy"
    server, child = (int(p) for p in pids.read_text().split())
    proc.send_signal(how)
    proc.wait(30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (_gone(server) and _gone(child)):
        time.sleep(0.2)
    assert _gone(server) and _gone(child)


def test_a_server_that_exits_before_it_is_healthy_fails_at_once(tmp_path: Path) -> None:
    s = LaunchedServer([sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"],
                       dict(os.environ), tmp_path / "s.log", f"http://127.0.0.1:{free_port()}")  # fmt: skip
    start = time.monotonic()
    with pytest.raises(ServerError, match="exited with code 3") as err:
        s.wait_healthy(60)
    assert time.monotonic() - start < 20
    assert "boom" in str(err.value) and "s.log" in str(err.value) and "command:" in str(err.value)
    s.stop()
