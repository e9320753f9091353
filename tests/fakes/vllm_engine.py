"""A stand-in for an in-process `vllm.LLM`, for the unit tests that run where vLLM cannot.

Like vLLM it starts from the weights on disk and takes new ones only through
``collective_rpc("reload_weights", ...)``; it decodes greedily with a transformers copy of the
model, so a test can tell which weights it serves. It records every call it gets. Its
`llm_engine` takes requests one by one as vLLM's in-process engine does (``add_request`` /
``step`` / ``abort_request``): a request is decoded when added and finishes after one step per
token, so requests of different lengths finish in order of length.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import torch

from mars2.models.loading import ModelSpec, load_policy


class Stepping:
    """Counts the engines of one runtime stepping at the same moment (vLLM allows one per process)."""

    def __init__(self, seconds: float = 0.0) -> None:
        self.seconds, self.now, self.peak = seconds, 0, 0
        self.lock = threading.Lock()

    def __enter__(self) -> None:
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
        time.sleep(self.seconds)

    def __exit__(self, *exc: object) -> None:
        with self.lock:
            self.now -= 1


class FakeLLM:
    def __init__(self, args: dict[str, Any], stepping: Stepping | None = None) -> None:
        self.args = args
        self.stepping = stepping or Stepping()
        self.calls: list[tuple[Any, ...]] = []
        self.model = load_policy(ModelSpec(args["model"]))
        self.model.eval()
        self.llm_engine = FakeEngine(self)

    def collective_rpc(self, method: str, kwargs: dict[str, Any]) -> None:
        assert method == "reload_weights" and kwargs["is_checkpoint_format"] is True
        self.calls.append((method,))
        self.model.load_state_dict(dict(kwargs["weights_iterator"]))

    def generate(self, prompts: list[dict[str, Any]], sampling: dict[str, Any], use_tqdm: bool = False,
                 lora_request: Any = None) -> list[Any]:  # fmt: skip
        self.calls.append(("generate", len(prompts)))
        return [SimpleNamespace(outputs=[self.sample(p, sampling)]) for p in prompts]

    def sample(self, prompt: dict[str, Any], sampling: dict[str, Any]) -> Any:
        ids = torch.tensor([prompt["prompt_token_ids"]])
        with torch.no_grad():
            out = self.model.generate(ids, do_sample=False, max_new_tokens=sampling["max_tokens"],
                                      min_new_tokens=sampling["max_tokens"])  # fmt: skip
        tokens = out[0, ids.shape[1] :].tolist()
        logprobs = [{t: SimpleNamespace(logprob=-1.0)} for t in tokens]
        return SimpleNamespace(text="", token_ids=tokens, logprobs=logprobs, finish_reason="length")

    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str]) -> None:
        self.calls.append(("wake_up", *tags))

    def reset_prefix_cache(self) -> None:
        self.calls.append(("reset_prefix_cache",))


class FakeEngine:
    """`vllm.LLM.llm_engine`: requests added one by one, one token of each per `step`."""

    def __init__(self, llm: FakeLLM) -> None:
        self.llm = llm
        self.running: dict[str, list[Any]] = {}  # request id: [steps left, sample]
        self.fail_next_step: BaseException | None = None

    def add_request(self, request_id: str, prompt: dict[str, Any], sampling: dict[str, Any],
                    lora_request: Any = None) -> None:  # fmt: skip
        assert request_id not in self.running, "request ids are unique"
        self.llm.calls.append(("add_request", request_id))
        self.running[request_id] = [sampling["max_tokens"], self.llm.sample(prompt, sampling)]

    def step(self) -> list[Any]:
        if self.fail_next_step is not None:
            error, self.fail_next_step = self.fail_next_step, None
            raise error
        with self.llm.stepping:
            return self._step()

    def _step(self) -> list[Any]:
        finished = []
        for request_id, entry in list(self.running.items()):
            entry[0] -= 1
            if entry[0] <= 0:
                del self.running[request_id]
                finished.append(SimpleNamespace(request_id=request_id, finished=True,
                                                outputs=[entry[1]]))  # fmt: skip
        return finished

    def abort_request(self, request_ids: list[str]) -> None:
        self.llm.calls.append(("abort", *request_ids))
        for request_id in request_ids:
            self.running.pop(request_id, None)

    def remove_lora(self, lora_id: int) -> None:
        self.llm.calls.append(("remove", lora_id))


class FakeRuntime:
    """What `EnginePool` uses to start engines, with `FakeLLM` in place of `vllm.LLM`."""

    def __init__(self, step_seconds: float = 0.0) -> None:
        self.started: list[FakeLLM] = []
        self.closed: list[FakeLLM] = []
        self.stepping = Stepping(step_seconds)

    def start(self, args: dict[str, Any]) -> FakeLLM:
        llm = FakeLLM(args, self.stepping)
        self.started.append(llm)
        return llm

    def sampling(self, **kwargs: Any) -> dict[str, Any]:
        return kwargs

    def lora_request(self, name: str, lora_id: int, path: str) -> Any:
        return SimpleNamespace(lora_name=name, lora_int_id=lora_id, lora_path=path)

    def close(self, llm: FakeLLM) -> None:
        self.closed.append(llm)
