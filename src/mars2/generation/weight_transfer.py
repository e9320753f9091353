"""The trainer side of vLLM's weight-transfer protocol, over HTTP, without vLLM in the trainer.

A vLLM server started with ``--weight-transfer-config '{"backend": ...}'`` (and
``VLLM_SERVER_DEV_MODE=1``) takes new weights in four phases: ``/init_weight_transfer_engine``
once (the trainer and the engine's workers form a broadcast group), then per update
``/start_weight_update``, ``/update_weights`` (one call per chunk: names, dtypes and shapes, while
the trainer broadcasts the tensors in that order), ``/finish_weight_update`` (with the new weight
version). `WeightSyncClient` speaks those routes (the same four methods as vLLM's
``HTTPVLLMWeightSyncClient``, which the trainer cannot import: it runs without vLLM);
`GlooSender` is the trainer's half of our CPU backend (`mars2.generation.vllm_plugin`);
`NcclSender` hands the broadcast to vLLM's own NCCL trainer engine (GPU, vLLM installed in the
trainer). Every call has a timeout and every failure raises.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

BACKEND = "gloo"
GROUP_PREFIX = "mars2-weights"
CHUNK_BYTES = 256 * 2**20


class ServerError(RuntimeError):
    """A vLLM server answered with an error, did not answer in time, or is gone."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def http_json(url: str, body: Any = None, *, timeout: float, method: str | None = None,
              headers: dict[str, str] | None = None) -> Any:  # fmt: skip
    """POST `body` as JSON (GET without one) and return the decoded answer; errors raise
    `ServerError` with the server's message."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method or ("GET" if body is None
                                                                       else "POST"))  # fmt: skip
    request.add_header("Content-Type", "application/json")
    for key, value in (headers or {}).items():
        request.add_header(key, value)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
    except urllib.error.HTTPError as err:
        detail = err.read().decode(errors="replace")[:2000]
        raise ServerError(f"{url} answered {err.code}: {detail}") from err
    except (urllib.error.URLError, OSError, TimeoutError, http.client.HTTPException) as err:
        raise ServerError(f"{url} did not answer within {timeout:.0f} s: {err}") from err
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except json.JSONDecodeError:  # some routes answer plain text (e.g. /v1/load_lora_adapter)
        return raw.decode(errors="replace")


def open_group(address: str, port: int, rank: int, world_size: int, timeout_s: float) -> Any:
    """A gloo process group of its own (never the default group of either process)."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(address, port, world_size, is_master=rank == 0, timeout=timeout)
    return dist.ProcessGroupGloo(dist.PrefixStore(GROUP_PREFIX, store), rank, world_size, timeout)


def broadcast(group: Any, tensor: torch.Tensor) -> None:
    """Broadcast `tensor` from rank 0 of `group`, in place."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


class WeightSyncClient:
    """The protocol's control plane for one server (what vLLM calls a `VLLMWeightSyncClient`)."""

    def __init__(self, base_url: str, timeout: float = 300.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout

    def _post(self, route: str, body: Any = None) -> Any:
        return http_json(f"{self.base_url}/{route}", {} if body is None else body,
                         timeout=self.timeout)  # fmt: skip

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._post("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._post("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._post("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._post("finish_weight_update", {"weight_version": weight_version})

    def update_weight_version(self, version: str) -> None:
        self._post("update_weight_version", {"new_version": version})

    def weight_version(self) -> str | None:
        answer = http_json(f"{self.base_url}/weight_info", timeout=self.timeout)
        return None if answer is None else answer.get("weight_version")


def _metadata(chunk: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    return {
        "names": [name for name, _ in chunk],
        "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in chunk],
        "shapes": [list(t.shape) for _, t in chunk],
    }


def chunks(weights: Iterable[tuple[str, torch.Tensor]],
           limit: int = CHUNK_BYTES) -> Iterator[list[tuple[str, torch.Tensor]]]:  # fmt: skip
    """Consecutive (name, tensor) lists of at most `limit` bytes (one tensor at least)."""
    chunk: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if chunk and size + nbytes > limit:
            yield chunk
            chunk, size = [], 0
        chunk.append((name, tensor))
        size += nbytes
    if chunk:
        yield chunk


def _concurrently(call: Any, work: Any) -> None:
    """Run the blocking HTTP `call` in a thread while `work` broadcasts; both must succeed."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as err:  # re-raised in the caller's thread below
            failure.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        work()
    finally:
        thread.join()
    if failure:
        raise failure[0]


class GlooSender:
    """The trainer's end of the ``gloo`` backend for one server (a server of tensor-parallel size
    `workers` has that many receiving ranks)."""

    backend = BACKEND

    def __init__(self, client: WeightSyncClient, address: str = "127.0.0.1",
                 workers: int = 1) -> None:  # fmt: skip
        self.client = client
        self.address = address
        self.workers = workers
        self.group: Any = None

    def init(self) -> None:
        port = free_port(self.address)
        info = {"master_address": self.address, "master_port": port,
                "world_size": 1 + self.workers, "rank_offset": 1,
                "timeout_s": self.client.timeout}  # fmt: skip

        def join() -> None:
            self.group = open_group(self.address, port, 0, 1 + self.workers, self.client.timeout)

        _concurrently(lambda: self.client.init_weight_transfer_engine(info), join)

    def send(self, weights: Iterable[tuple[str, torch.Tensor]], version: str) -> None:
        if self.group is None:
            self.init()
        self.client.start_weight_update()
        for chunk in chunks(weights):
            cpu = [(name, t.detach().to("cpu").contiguous()) for name, t in chunk]

            def push(cpu: list[tuple[str, torch.Tensor]] = cpu) -> None:
                for _, tensor in cpu:
                    broadcast(self.group, tensor)

            _concurrently(lambda cpu=cpu: self.client.update_weights(_metadata(cpu)), push)
        self.client.finish_weight_update(version)


class NcclSender:
    """The ``nccl`` backend: vLLM's own `NCCLTrainerWeightTransferEngine` (GPU trainers with vLLM
    installed), driven through the same `WeightSyncClient`. Untested here: no GPU on CI."""

    backend = "nccl"

    def __init__(self, client: WeightSyncClient, address: str = "127.0.0.1",
                 workers: int = 1) -> None:  # fmt: skip
        self.client = client
        self.address = address
        self.workers = workers
        self.engine: Any = None
        self._weights: list[tuple[str, torch.Tensor]] = []

    def send(self, weights: Iterable[tuple[str, torch.Tensor]], version: str) -> None:
        try:
            from vllm.distributed.weight_transfer.base import WeightSource
            from vllm.distributed.weight_transfer.nccl_engine import (
                NCCLTrainerInitInfo,
                NCCLTrainerWeightTransferEngine,
            )
        except ImportError as err:
            raise ImportError(
                "weight_transfer=nccl drives vLLM's NCCL trainer engine and needs vLLM in the "
                "trainer (pip install '.[gpu]'); on CPU use weight_transfer=gloo"
            ) from err
        sender = self

        class _Source(WeightSource):  # the current step's tensors, on the trainer's GPU
            def metadata(self) -> Any:
                from vllm.distributed.weight_transfer.base import ParamMeta

                return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in sender._weights]

            def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
                return iter(sender._weights)

        self._weights = [(n, t.detach().cuda()) for n, t in weights]
        if self.engine is None:
            info = NCCLTrainerInitInfo(master_address=self.address,
                                       master_port=free_port(self.address),
                                       world_size=1 + self.workers, rank=0)  # fmt: skip
            self.engine = NCCLTrainerWeightTransferEngine.trainer_init(
                info, client=self.client, source=_Source()
            )
        self.engine.send_weights()  # start, update (concurrent broadcasts), finish
        self.client.update_weight_version(version)
        self._weights = []


SENDERS: dict[str, Any] = {"gloo": GlooSender, "nccl": NcclSender}
