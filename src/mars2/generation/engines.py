"""The vLLM engines of one run: started on demand, shared where agents share a base, closed at the end.

`VLLMRuntime` is the only place that touches the ``vllm`` package (engine start, sampling
parameters, LoRA requests, shutdown), so tests can swap in a fake where vLLM cannot run.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from mars2.generation.engine_group import EngineGroup

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _scoped_environ(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the duration of the block, then restore the old ones."""
    old = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _launcher_ranks() -> dict[str, str]:
    """RANK and LOCAL_RANK for vLLM's external_launcher, which reads them from the environment.

    torchrun sets both; Lightning's own launcher and SLURM (`srun`) do not set RANK, so they are
    taken from the trainer's process group (already initialised) and its device where missing.
    """
    import torch.distributed as dist

    env: dict[str, str] = {}
    if "RANK" not in os.environ and dist.is_available() and dist.is_initialized():
        env["RANK"] = str(dist.get_rank())
    if "LOCAL_RANK" not in os.environ:
        local = os.environ.get("SLURM_LOCALID")
        if local is None:
            local = str(torch.cuda.current_device()) if torch.cuda.is_available() else "0"
        env["LOCAL_RANK"] = local
    return env


class VLLMRuntime:
    """Starts in-process vLLM engines and builds the objects they take."""

    def _vllm(self) -> Any:
        try:
            import vllm
        except ImportError as err:
            raise ImportError(
                "generation.backend=vllm needs vLLM: pip install '.[gpu]' (or `make test-vllm` "
                "for the CPU build used in tests)"
            ) from err
        return vllm

    def start(self, args: dict[str, Any]) -> Any:
        """An `vllm.LLM` in this process, with the trainer's torch thread count restored after."""
        vllm = self._vllm()
        threads = torch.get_num_threads()
        # The trainer hands tensors to the engine by reference (collective_rpc with a weights
        # iterator), so the engine core must run in this process. vLLM reads the switch while the
        # engine is built and caches it; the caller's environment is restored afterwards.
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        if args.get("distributed_executor_backend") == "external_launcher":
            env.update(_launcher_ranks())
        with _scoped_environ(env):
            llm = vllm.LLM(**args)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        return llm

    def sampling(self, **kwargs: Any) -> Any:
        return self._vllm().SamplingParams(**kwargs)

    def lora_request(self, name: str, lora_id: int, path: str) -> Any:
        from vllm.lora.request import LoRARequest

        return LoRARequest(name, lora_id, path)

    def close(self, llm: Any) -> None:
        engine = getattr(llm, "llm_engine", None)
        parallel = getattr(getattr(engine, "vllm_config", None), "parallel_config", None)
        if getattr(parallel, "distributed_executor_backend", None) == "external_launcher":
            # Shutting it down would destroy the trainer's process group, which the engine joined;
            # its memory is freed when the last reference goes.
            return
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()


class EnginePool:
    """Engines keyed by what they serve (an agent, or a base model shared by LoRA agents).

    A key is started once with the arguments of its first request; a later request for the same key
    with different arguments is an error rather than a silent reuse. `close` shuts every engine
    down and removes the adapters written for shared-base engines.
    """

    def __init__(self, runtime: Any = None, log_dir: Path | None = None) -> None:
        self.runtime = runtime or VLLMRuntime()
        self.log_dir = log_dir  # where launched vLLM servers write their logs (run folder)
        self._closers: list[Any] = []
        self._engines: dict[str, Any] = {}
        self._args: dict[str, dict[str, Any]] = {}
        self._workdir: Path | None = None
        self._lora_ids: dict[str, Iterator[int]] = {}
        self._loop: Any = None
        self._group: EngineGroup | None = None
        self._tp_size: int | None = None

    def engine(self, key: str, args: dict[str, Any]) -> Any:
        """The engine for `key`, started with `args` on first use."""
        if key in self._engines:
            if self._args[key] != args:
                raise ValueError(
                    f"engine {key!r} was started with {self._args[key]} and is now asked for "
                    f"{args}: agents sharing an engine must agree on its settings"
                )
            return self._engines[key]
        log.info("starting vLLM engine %s", key)
        self._engines[key] = self.runtime.start(args)
        self._args[key] = dict(args)
        return self._engines[key]

    def loop(self) -> Any:
        """The request loop of the pool's engines (`mars2.generation.vllm_async.EngineLoop`):
        one for all of them, so that no two engines of this process step at once."""
        if self._loop is None:
            from mars2.generation.vllm_async import EngineLoop

            self._loop = EngineLoop()
        return self._loop

    def __contains__(self, key: str) -> bool:
        return key in self._engines

    def __len__(self) -> int:
        return len(self._engines)

    def workdir(self) -> Path:
        """A scratch folder owned by the pool (LoRA adapters handed to shared engines)."""
        if self._workdir is None:
            self._workdir = Path(tempfile.mkdtemp(prefix="mars2-engines-"))
        return self._workdir

    def engine_group(self, size: int) -> EngineGroup | None:
        """The ranks sharing this run's tensor-parallel engines (None for size 1): one size a run."""
        if self._tp_size is not None and self._tp_size != size:
            raise ValueError(
                f"vLLM agents of one run must share one tensor_parallel_size (got "
                f"{self._tp_size} and {size}): vLLM sets its parallel groups up once per process"
            )
        self._tp_size = size
        if size > 1 and self._group is None:
            self._group = EngineGroup(size)
        return self._group

    def on_close(self, close: Any) -> None:
        """Call `close()` when the pool closes (launched vLLM servers, their request threads)."""
        self._closers.append(close)

    def server_log_dir(self) -> Path:
        """The folder of launched servers' logs: the run's `log_dir`, else the pool's scratch."""
        folder = self.log_dir if self.log_dir is not None else self.workdir() / "servers"
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def lora_ids(self, key: str) -> Iterator[int]:
        """Fresh LoRA request ids for the engine `key` (never reused while it runs)."""
        return self._lora_ids.setdefault(key, itertools.count(1))

    def close(self) -> None:
        """Shut every engine down and free what the pool wrote; the pool can be reused after."""
        closers, self._closers = self._closers[::-1], []
        for close in closers:
            try:
                close()
            except Exception:  # one server failing to stop must not keep the others running
                log.exception("closing %s failed", close)
        engines, self._engines, self._args = self._engines, {}, {}
        self._lora_ids = {}
        if self._loop is not None:  # nothing may still be stepping an engine that shuts down
            self._loop.cancel()
            self._loop = None
        self._group, self._tp_size = None, None
        for key, llm in engines.items():
            try:
                self.runtime.close(llm)
            except Exception:  # one engine failing to stop must not keep the others running
                log.exception("closing vLLM engine %s failed", key)
        del engines
        gc.collect()
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def __enter__(self) -> EnginePool:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
