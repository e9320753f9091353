"""``generation.backend=vllm_server``: an agent's engine is a vLLM server (disaggregated layout).

Two ways to get servers, set in ``generation.server``:

- ``launch`` (the default, no ``urls``): mars2 starts ``python -m vllm.entrypoints.openai.api_server``
  for the agent with the configured interpreter (``python`` or ``venv``), on a free port, streams
  its log to ``<run>/servers/<agent>.log``, waits for ``/health`` (``health_timeout_s``; a server
  that exits first fails at once with its command line and log tail) and stops it, and only it,
  when the run ends (`LaunchedServer`: own process group, parent-death signal, killed on close);
- ``urls``: servers already running elsewhere; requests go to the least busy one.

Requests are token ids in, token ids and log-probs out (``/v1/completions`` with
``return_token_ids``; the server runs ``--logprobs-mode processed_logprobs``), so nothing is
re-tokenised. `generate` sends a step's requests at once; `submit` (the pipelined driver) sends
them one by one and reports each as it finishes. Weights go in through vLLM's weight-transfer
protocol (`mars2.generation.weight_transfer`, ``gloo`` on CPU, ``nccl`` on GPU); a LoRA agent's
adapter is written once per sync and hot-loaded under a new name (``/v1/load_lora_adapter``), the
old one unloaded (with in-flight updates, one sync later: `keep_adapters`). A full-weight sync pauses the server with ``mode=keep`` (in-flight requests
wait, none is lost) and is checked afterwards: the server reports the new weight version and,
when the trainer's weights changed, a different weight checksum. A frozen teammate
(``trainable: false``) is never synced; it may also use ``api: chat`` (messages to
``/v1/chat/completions`` of any OpenAI-compatible endpoint, answers re-tokenised, no log-probs).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import logging
import os
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from mars2.generation.base import Completion, DoneCallback, Messages
from mars2.generation.config import GenerationConfig
from mars2.generation.prompt import encode_prompt, encode_prompt_noting_cut
from mars2.generation.weight_transfer import (
    SENDERS,
    ServerError,
    WeightSyncClient,
    free_port,
    http_json,
)

log = logging.getLogger(__name__)

# Keys of GenerationConfig.server (anything else is refused: a typo must not be ignored).
SERVER_KEYS = (
    "urls", "python", "venv", "args", "env", "host", "health_timeout_s", "request_timeout_s",
    "sync_timeout_s", "weight_transfer", "trainer_address", "model_name", "max_in_flight",
    "verify", "frozen", "log_dir", "api", "api_key_env",
)  # fmt: skip
# How requests are sent: token ids to /v1/completions (vLLM; what a trained agent needs), or the
# chat's messages to /v1/chat/completions (any OpenAI-compatible endpoint; frozen teammates only).
APIS = ("tokens", "chat")
PLUGIN_ENTRY = "mars2_gloo = mars2.generation.vllm_plugin:register"
LOG_TAIL_CHARS = 4000


def check_server_config(name: str, server: dict[str, Any] | None) -> dict[str, Any]:
    """The agent's ``generation.server`` settings, validated (unknown keys and bad values raise)."""
    server = dict(server or {})
    if "api_key" in server:
        raise ValueError(
            f"agent {name!r}: generation.server.api_key would put a secret in the run's config "
            "(it is logged): set api_key_env to the name of an environment variable holding it"
        )
    unknown = sorted(set(server) - set(SERVER_KEYS))
    if unknown:
        raise ValueError(
            f"agent {name!r}: unknown generation.server keys {unknown}; known: "
            f"{', '.join(SERVER_KEYS)}"
        )
    urls = server.get("urls")
    if isinstance(urls, str):
        server["urls"] = [urls]
    if server.get("urls") is not None and not server["urls"]:
        raise ValueError(f"agent {name!r}: generation.server.urls is empty (omit it to launch)")
    if server.get("urls") and (server.get("python") or server.get("venv")):
        raise ValueError(
            f"agent {name!r}: generation.server has both urls (servers running elsewhere) and "
            "python/venv (a server to launch): choose one"
        )
    transfer = server.get("weight_transfer", "nccl" if torch.cuda.is_available() else "gloo")
    if transfer not in SENDERS:
        raise ValueError(
            f"agent {name!r}: generation.server.weight_transfer={transfer!r}: use one of "
            f"{', '.join(SENDERS)} (gloo on CPU, nccl on GPU)"
        )
    server["weight_transfer"] = transfer
    verify = server.get("verify", "checksum")
    if verify not in ("checksum", "version"):
        raise ValueError(f"agent {name!r}: generation.server.verify must be checksum or version")
    server["verify"] = verify
    api = server.get("api", "tokens")
    if api not in APIS:
        raise ValueError(
            f"agent {name!r}: generation.server.api={api!r}: use tokens (token ids to "
            "/v1/completions, vLLM) or chat (messages to /v1/chat/completions, any "
            "OpenAI-compatible endpoint, frozen teammates only)"
        )
    server["api"] = api
    if server.get("api_key_env") and not os.environ.get(str(server["api_key_env"])):
        raise ValueError(
            f"agent {name!r}: generation.server.api_key_env={server['api_key_env']} names an "
            "environment variable that is not set (or is empty)"
        )
    for key in ("health_timeout_s", "request_timeout_s", "sync_timeout_s", "max_in_flight"):
        if key in server and not float(server[key]) > 0:
            raise ValueError(f"agent {name!r}: generation.server.{key} must be > 0")
    return server


def _interpreter(server: dict[str, Any]) -> str:
    """The server's python: ``python``, else ``venv``'s, else this one when it has vLLM, else the
    checkout's ``.venv-vllm`` (what `make test-vllm` builds)."""
    if server.get("python"):
        return str(server["python"])
    if server.get("venv"):
        return str(Path(server["venv"]) / "bin" / "python")
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    import mars2

    checkout = Path(mars2.__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
    if checkout.exists():
        return str(checkout)
    raise ValueError(
        "generation.backend=vllm_server launches a vLLM server but vLLM is not installed here and "
        "the checkout has no .venv-vllm: set generation.server.venv (or .python) to an "
        "interpreter with vLLM (`make test-vllm` builds .venv-vllm), or point "
        "generation.server.urls at running servers"
    )


def _flags(args: dict[str, Any]) -> list[str]:
    """``{"max-model-len": 512, "enforce-eager": True}`` → ``--max-model-len 512 --enforce-eager``."""
    out: list[str] = []
    for key, value in args.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False or value is None:
            continue
        else:
            out += [flag, json.dumps(value) if isinstance(value, dict | list) else str(value)]
    return out


def write_plugin_shim(folder: Path) -> Path:
    """A folder holding only the metadata of our vLLM plugin entry point, for the server's
    PYTHONPATH: vLLM discovers ``vllm.general_plugins`` through importlib.metadata in every process
    it starts, so a launched server finds the ``gloo`` backend whatever is installed in its venv
    (an installed mars2 declares the same entry point in pyproject.toml)."""
    dist = folder / "mars2_vllm_plugins-0.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: mars2-vllm-plugins\nVersion: 0.0\n"
    )
    (dist / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{PLUGIN_ENTRY}\n")
    return folder


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: SIGTERM when the trainer dies


def tail(path: Path, chars: int = LOG_TAIL_CHARS) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - chars))
            return f.read().decode(errors="replace")
    except OSError:
        return "(no log)"


def first_errors(path: Path, count: int = 8) -> str:
    """The log's first lines that name an error (the root cause, often far above the tail)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    found = [line for line in lines if "Error" in line or "ERROR" in line][:count]
    return "first errors in the log:\n" + "\n".join(found) + "\n" if found else ""


class LaunchedServer:
    """One ``vllm`` API server process started by mars2, in a process group of its own.

    The server runs under `mars2.generation.server_guard`, which leads the group and ends all of
    it when the trainer dies (also after ``kill -9``; the guard itself gets SIGTERM through
    ``PR_SET_PDEATHSIG`` and also polls its parent); `stop` signals the group (SIGTERM, then
    SIGKILL after `grace_s`), never anything else.
    """

    def __init__(self, command: list[str], env: dict[str, str], log_path: Path, url: str) -> None:
        self.command, self.log_path, self.url = command, log_path, url
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("ab")
        guard = [sys.executable, "-m", "mars2.generation.server_guard", str(os.getpid()), "--"]
        self.process = subprocess.Popen([*guard, *command], env=env, stdout=self._log,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=True,
                                        preexec_fn=_die_with_parent)  # fmt: skip
        log.info("launched vLLM server %s (pid %d, log %s)", url, self.process.pid, log_path)

    @property
    def pid(self) -> int:
        return int(self.process.pid)

    def alive(self) -> bool:
        return self.process.poll() is None

    def describe(self) -> str:
        return (
            f"command: {shlex.join(self.command)}\nlog: {self.log_path}\n"
            f"{first_errors(self.log_path)}last lines of the log:\n{tail(self.log_path)}"
        )

    def wait_healthy(self, timeout_s: float) -> None:
        """Return once ``/health`` answers 200; raise at once if the process exits first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise ServerError(
                    f"the vLLM server exited with code {self.process.returncode} before it became "
                    f"healthy.\n{self.describe()}"
                )
            with contextlib.suppress(ServerError):
                http_json(f"{self.url}/health", timeout=5, method="GET")
                return
            time.sleep(0.5)
        raise ServerError(
            f"the vLLM server did not become healthy within {timeout_s:.0f} s "
            f"(generation.server.health_timeout_s).\n{self.describe()}"
        )

    def stop(self, grace_s: float = 20.0) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        else:  # the leader is gone; make sure no engine process of its group lingers
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
        self._log.close()


def launch_server(name: str, model_spec: Any, server: dict[str, Any], log_dir: Path,
                  lora_rank: int = 0) -> LaunchedServer:  # fmt: skip
    """Start (and wait for) a vLLM server for agent `name` serving `model_spec`'s weights."""
    host = str(server.get("host", "127.0.0.1"))
    port = free_port(host)
    args: dict[str, Any] = {
        "model": model_spec.path,
        "served-model-name": server.get("model_name", name),
        "host": host,
        "port": port,
        "dtype": model_spec.dtype,
        "logprobs-mode": "processed_logprobs",
        "trust-remote-code": bool(getattr(model_spec, "trust_remote_code", False)),
    }
    if not server.get("frozen"):
        if lora_rank:
            from mars2.generation.vllm_backend import lora_rank as accepted_rank

            args.update({"enable-lora": True, "max-lora-rank": accepted_rank(lora_rank)})
        else:
            args["weight-transfer-config"] = {"backend": server["weight_transfer"]}
    args.update(server.get("args") or {})
    command = [_interpreter(server), "-m", "vllm.entrypoints.openai.api_server", *_flags(args)]
    import mars2

    source = str(Path(mars2.__file__).resolve().parents[1])
    shim = write_plugin_shim(log_dir / "plugins")
    env = dict(os.environ)
    env.update({"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(shim), source, os.environ.get("PYTHONPATH", "")) if p
    )
    env.update({str(k): str(v) for k, v in (server.get("env") or {}).items()})
    launched = LaunchedServer(command, env, log_dir / f"{name}.log", f"http://{host}:{port}")
    try:
        launched.wait_healthy(float(server.get("health_timeout_s", 600)))
    except BaseException:
        launched.stop(grace_s=5)
        raise
    return launched


class Endpoints:
    """An agent's servers; each request goes to the one with the fewest requests in flight."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self._busy = dict.fromkeys(self.urls, 0)
        self._order = itertools.count()
        self._lock = threading.Lock()

    def acquire(self) -> str:
        with self._lock:
            turn = next(self._order)  # ties go round-robin
            n = len(self.urls)
            url = min((self.urls[(turn + i) % n] for i in range(n)), key=self._busy.__getitem__)
            self._busy[url] += 1
            return url

    def release(self, url: str) -> None:
        with self._lock:
            self._busy[url] -= 1

    def in_flight(self) -> int:
        with self._lock:
            return sum(self._busy.values())


def completion_request(model: str, prompt: list[int], config: GenerationConfig,
                       seed: int | None) -> dict[str, Any]:  # fmt: skip
    """The ``/v1/completions`` body for one prompt given as token ids."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": config.max_new_tokens,
        "temperature": config.temperature,
        "top_p": config.top_p,
        "logprobs": 0,  # the sampled token's log-prob
        "return_token_ids": True,
        "n": 1,
    }
    if seed is not None:
        body["seed"] = seed
    return body


def chat_request(model: str, chat: Messages, config: GenerationConfig,
                 seed: int | None) -> dict[str, Any]:  # fmt: skip
    """The ``/v1/chat/completions`` body for one chat (the server applies its own template)."""
    body: dict[str, Any] = {
        "model": model,
        "messages": list(chat),
        "max_tokens": config.max_new_tokens,
        "temperature": config.temperature,
        "top_p": config.top_p,
        "n": 1,
    }
    if seed is not None:
        body["seed"] = seed
    return body


def _retokenised(text: str, finished: bool, tokenizer: Any) -> list[int]:
    """The answer's tokens in the agent's tokenizer (plus EOS when it ended by itself)."""
    tokens = [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]
    if finished and tokenizer.eos_token_id is not None:
        tokens.append(int(tokenizer.eos_token_id))
    return tokens


def parse_completion(
    prompt: list[int], answer: dict[str, Any], tokenizer: Any = None
) -> Completion:
    """A `Completion` from a ``/v1/completions`` answer (``return_token_ids``, ``logprobs=0``).

    Without token ids in the answer (a server that ignores ``return_token_ids``) the text is
    re-tokenised with `tokenizer` when one is given (frozen teammates: nothing trains on their
    tokens), and refused otherwise.
    """
    choice = answer["choices"][0]
    tokens = [int(t) for t in choice.get("token_ids") or []]
    text = choice.get("text") or ""
    truncated = choice.get("finish_reason") == "length"
    if not tokens and text:
        if tokenizer is None:
            raise ServerError(
                "the server's completion has text but no token_ids: a trained agent needs a "
                "server that honours return_token_ids (vLLM >= 0.10); other OpenAI-compatible "
                "endpoints can serve frozen teammates (trainable: false), whose answers are "
                "re-tokenised"
            )
        return Completion(text=text, prompt_token_ids=list(prompt), logprobs=None,
                          token_ids=_retokenised(text, not truncated, tokenizer),
                          truncated=truncated)  # fmt: skip
    logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
    values = None if logprobs is None else [float(x) for x in logprobs]
    return Completion(
        text=text,
        prompt_token_ids=list(prompt),
        token_ids=tokens,
        logprobs=values if values is not None and len(values) == len(tokens) else None,
        truncated=truncated,
    )


def parse_chat_completion(prompt: list[int], answer: dict[str, Any], tokenizer: Any) -> Completion:
    """A `Completion` from a ``/v1/chat/completions`` answer: the message's text, re-tokenised
    with the agent's tokenizer, no log-probs (`prompt` is the chat in that tokenizer)."""
    try:
        choice = answer["choices"][0]
        text = choice["message"].get("content") or ""
    except (KeyError, IndexError, TypeError, AttributeError) as err:
        raise ServerError(
            f"the chat completion answer has no choices[0].message: {str(answer)[:500]}"
        ) from err
    truncated = choice.get("finish_reason") == "length"
    return Completion(text=text, prompt_token_ids=list(prompt), logprobs=None,
                      token_ids=_retokenised(text, not truncated, tokenizer),
                      truncated=truncated)  # fmt: skip


class VLLMServerGenerator:
    """An agent sampled by vLLM servers; `sync_weights` pushes the trainer's weights to all."""

    # Its weights live in other processes and a sync pauses them with mode=keep (in-flight
    # requests wait and go on with the new weights): generation may overlap the trainer's updates.
    overlaps_updates = True

    def __init__(
        self,
        name: str,
        tokenizer: Any,
        config: GenerationConfig,
        urls: Sequence[str],
        server: dict[str, Any],
        lora: bool = False,
        adapter_dir: Path | None = None,
        describe: Callable[[str], str] | None = None,
    ) -> None:
        self.name, self.tokenizer, self.config = name, tokenizer, config
        self.server = server
        self.endpoints = Endpoints(urls)
        self.model = str(server.get("model_name", name))
        self.base_model = self.model
        self.max_in_flight = int(server.get("max_in_flight", 64))
        self.request_timeout = float(server.get("request_timeout_s", 600))
        self.sync_timeout = float(server.get("sync_timeout_s", 300))
        self.frozen = bool(server.get("frozen"))
        self.api = str(server.get("api", "tokens"))
        key_env = server.get("api_key_env")
        self._headers = {"Authorization": f"Bearer {os.environ[str(key_env)]}"} if key_env else {}
        self.lora = lora
        self.adapter_dir = adapter_dir
        self._describe = describe or (lambda url: f"server {url}")
        self._pool = ThreadPoolExecutor(self.max_in_flight, thread_name_prefix=f"{name}-http")
        self._senders: dict[str, Any] = {}
        self._fingerprint: list[float] | None = None
        self._checksums: dict[str, Any] = {}
        self._adapters: list[tuple[str, Path]] = []  # loaded, oldest first
        self._token = secrets.token_hex(3)
        # Adapters kept loaded: 2 with in-flight updates, where requests asked for before a sync
        # still name the previous adapter (they end before the next sync, at the step boundary).
        self.keep_adapters = 1
        self._loaded = 0
        self.weights_version = 0
        self.sync_seconds = 0.0
        # edits each request body before it is sent (benchmarks force answer lengths with it)
        self.request_hook: Callable[[dict[str, Any]], None] | None = None
        self.launched: LaunchedServer | None = None  # the server mars2 started for it, if any

    # --- requests -------------------------------------------------------------------------
    def encode_prompt(self, chat: Messages) -> list[int]:
        return encode_prompt(self.tokenizer, chat, self.config.max_prompt_tokens)

    def encode_noting_cut(self, chat: Messages) -> tuple[list[int], bool]:
        return encode_prompt_noting_cut(self.tokenizer, chat, self.config.max_prompt_tokens)

    def _one(self, prompt: list[int], seed: int, chat: Messages, cut: bool = False) -> Completion:
        version = self.weights_version
        url = self.endpoints.acquire()
        chatting = self.api == "chat"
        try:
            if chatting:
                body = chat_request(self.model, chat, self.config, seed)
            else:
                body = completion_request(self.model, prompt, self.config, seed)
            if self.request_hook is not None:
                self.request_hook(body)
            route = "v1/chat/completions" if chatting else "v1/completions"
            try:
                answer = http_json(f"{url}/{route}", body, timeout=self.request_timeout,
                                   headers=self._headers)  # fmt: skip
                if chatting:
                    completion = parse_chat_completion(prompt, answer, self.tokenizer)
                else:
                    completion = parse_completion(
                        prompt, answer, self.tokenizer if self.frozen else None
                    )
            except ServerError as err:
                raise ServerError(f"agent {self.name!r}: a request failed: {err}\n"
                                  f"{self._describe(url)}") from err  # fmt: skip
            completion.weights_version = version
            completion.prompt_cut = cut and not chatting  # the chat API sent the messages uncut
            return completion
        finally:
            self.endpoints.release(url)

    def _seeds(self, n: int) -> list[int]:  # from the trainer's seeded generator: reproducible
        return torch.randint(0, 2**62, (n,)).tolist()

    def generate(self, chats: Sequence[Messages]) -> list[Completion]:
        encoded = [self.encode_noting_cut(c) for c in chats]
        futures = [self._pool.submit(self._one, p, s, c, cut)
                   for (p, cut), s, c in zip(encoded, self._seeds(len(encoded)), chats,
                                             strict=True)]  # fmt: skip
        errors = []
        results = []
        for future in futures:  # every request finishes (or fails) before the step goes on
            try:
                results.append(future.result())
            except BaseException as err:
                errors.append(err)
        if errors:
            raise errors[0]
        return results

    def submit(self, chats: Sequence[Messages], done: DoneCallback) -> None:
        encoded = [self.encode_noting_cut(c) for c in chats]
        for index, ((prompt, cut), seed, chat) in enumerate(zip(encoded, self._seeds(len(encoded)),
                                                                chats, strict=True)):  # fmt: skip
            future = self._pool.submit(self._one, prompt, seed, chat, cut)

            def report(f: Future[Completion], index: int = index) -> None:
                error = f.exception()
                done(index, error if error is not None else f.result())

            future.add_done_callback(report)

    # --- weights --------------------------------------------------------------------------
    def sync_weights(self, policy: Any) -> None:
        if self.frozen and self.weights_version == 0:  # serves its own weights from the start
            self.weights_version = 1
            return
        if self.frozen:
            raise RuntimeError(
                f"agent {self.name!r} is a frozen teammate (trainable: false): its server's "
                "weights are never pushed; a frozen agent must not be trained"
            )
        start = time.monotonic()
        if self.lora:
            self._sync_adapter(policy)
        else:
            for url in self.endpoints.urls:
                self._sync_full(url, policy)
        self.weights_version += 1
        self.sync_seconds = time.monotonic() - start

    def _sync_full(self, url: str, policy: Any) -> None:
        from mars2.generation.vllm_backend import streamed_weights

        version = f"{self.name}-{self.weights_version + 1}"
        sender = self._senders.get(url)
        if sender is None:
            client = WeightSyncClient(url, timeout=self.sync_timeout)
            sender = SENDERS[self.server["weight_transfer"]](
                client, str(self.server.get("trainer_address", "127.0.0.1"))
            )
            self._senders[url] = sender
        fingerprint: list[float] = []

        def weights() -> Any:
            for name, tensor in streamed_weights(policy):
                fingerprint.append(float(tensor.detach().double().sum()))
                yield name, tensor

        post = lambda route: http_json(f"{url}/{route}", {}, timeout=self.sync_timeout)  # noqa: E731
        try:
            http_json(f"{url}/pause?mode=keep", {}, timeout=self.sync_timeout)
            try:
                sender.send(weights(), version)
            finally:
                post("resume")
            self._verify(url, version, fingerprint)
        except ServerError as err:
            raise ServerError(
                f"agent {self.name!r}: weight sync to {url} failed (timeout "
                f"{self.sync_timeout:.0f} s, generation.server.sync_timeout_s): {err}\n"
                f"{self._describe(url)}"
            ) from err

    def _verify(self, url: str, version: str, fingerprint: list[float]) -> None:
        """The engine took this update: its weight version, and (verify=checksum) its weights
        changed exactly when the trainer's did."""
        served = WeightSyncClient(url, timeout=self.sync_timeout).weight_version()
        if served != version:
            raise ServerError(f"after the update the server reports weight version {served!r}, "
                              f"expected {version!r}")  # fmt: skip
        if self.server["verify"] != "checksum":
            return
        answer = http_json(f"{url}/weight_checker", {"action": "checksum"},
                           timeout=self.sync_timeout)  # fmt: skip
        checksums = answer["checksums"]
        previous = self._checksums.get(url)
        trainer_changed = self._fingerprint is not None and fingerprint != self._fingerprint
        if previous is not None and trainer_changed and checksums == previous:
            raise ServerError(
                "the trainer's weights changed but the server's weight checksums did not: the "
                "update was not applied (check the server log for the weight transfer engine)"
            )
        self._checksums[url] = checksums
        self._fingerprint = fingerprint

    def _sync_adapter(self, policy: Any) -> None:
        from mars2.generation.vllm_backend import adapter_state

        if self.adapter_dir is None:
            raise ValueError(f"agent {self.name!r}: a LoRA agent on servers needs an adapter_dir")
        self._loaded += 1
        # unique to this generator: a server at `urls` may still hold another run's adapters
        lora_name = f"{self.base_model}-lora-{self._token}-{self._loaded}"
        path = self.adapter_dir / lora_name
        policy.save_pretrained(str(path), state_dict=adapter_state(policy))
        for url in self.endpoints.urls:
            try:
                http_json(f"{url}/v1/load_lora_adapter",
                          {"lora_name": lora_name, "lora_path": str(path)},
                          timeout=self.sync_timeout)  # fmt: skip
                served = http_json(f"{url}/v1/models", timeout=self.sync_timeout)
                if lora_name not in {m.get("id") for m in served.get("data", [])}:
                    raise ServerError(f"{lora_name} is not among the served models after loading")
            except ServerError as err:
                raise ServerError(f"agent {self.name!r}: loading adapter {lora_name} into {url} "
                                  f"failed: {err}\n{self._describe(url)}") from err  # fmt: skip
        self._adapters.append((lora_name, path))
        self.model = lora_name
        while len(self._adapters) > self.keep_adapters:
            old = self._adapters.pop(0)
            for url in self.endpoints.urls:
                with contextlib.suppress(ServerError):  # a leftover adapter costs only memory
                    http_json(f"{url}/v1/unload_lora_adapter", {"lora_name": old[0]},
                              timeout=self.sync_timeout)  # fmt: skip
            import shutil

            shutil.rmtree(old[1], ignore_errors=True)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
