"""A generative reward model (an LLM judge) served to the reward function: verl's GenRM contract.

With ``reward_model.enable=True``, ``custom_reward_function.path`` set and ``reward_model.model.path`` a causal
language model (not a ``*ForSequenceClassification`` checkpoint, which runs as the Megatron reward-model role,
``meshrl.workers.reward_model``), a run starts a vLLM OpenAI-compatible server for that model before the first
step and stops it when the run ends, however it ends. Every call of the reward function then gets two more
keyword arguments, as verl's reward loop passes them:

- ``reward_router_address``: ``"host:port"`` of the server; ``POST http://{address}/v1/chat/completions`` (or
  ``/v1/completions``) asks the judge. The model's served names are ``reward_model.model.path`` as written and its
  resolved folder; requests may also leave ``model`` out;
- ``reward_model_tokenizer``: the judge's tokenizer (transformers), to render a prompt or count its tokens.

The function builds the judge's prompt from the response, asks, and parses a score: the prompt template and the
parser are the user's, as in verl. It may be ``async def`` (verl's recommended form for model calls): meshrl's
reward processes then run each worker's calls concurrently, so the server batches them
(``meshrl.rewards.pool``). :func:`chat_complete` is a small client for such functions.

Server settings come from verl's ``reward_model.rollout.*`` (each follows ``reward.reward_model.rollout.*``, the
newer home, unless set itself): ``name`` (vllm), ``dtype``, ``tensor_model_parallel_size``,
``data_parallel_size``, ``max_model_len`` (default ``prompt_length + response_length``), ``max_num_seqs``,
``max_num_batched_tokens``, ``gpu_memory_utilization`` (GPU) or ``kv_cache_memory_bytes`` (CPU; meshrl's key,
1 GiB when null), ``enforce_eager``, ``enable_chunked_prefill``, ``enable_prefix_caching``, ``disable_log_stats``,
``seed``, ``engine_kwargs.vllm`` (more server options, ``--name value``). Refused: another engine,
``skip_tokenizer_init`` (the chat endpoint renders with the tokenizer), ``load_format`` other than auto /
safetensors (a judge with random weights), ``expert_parallel_size`` > 1.

Not built: the judge sleeping between uses (verl's colocated ``free_cache_engine``): on GPU it holds
``gpu_memory_utilization`` of the first ``tensor_model_parallel_size x data_parallel_size`` GPUs of the driver's
node for the whole run, beside the training ranks; a separate resource pool (``enable_resource_pool``) is refused
as for the discriminative model.

``python -m meshrl.rewards.judge serve --model PATH [--port P] [--tensor-parallel-size N] [--dtype D]`` serves a
judge alone, until SIGTERM/SIGINT, and prints its address (for a function tried outside a run).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshrl.config.refusals import Checked, refusal
from meshrl.config.reward_model_kind import judge_rollout

# The arguments verl's reward loop adds to a custom function's call when the reward model is served.
JUDGE_ARGUMENTS = ("reward_router_address", "reward_model_tokenizer")
CPU_DEFAULT_KV_BYTES = 1 << 30  # as the rollout engine's default on CPU
LOAD_FORMATS = ("auto", "safetensors")
START_TIMEOUT_S = 600.0  # a cold vLLM start on a busy 2-core machine takes 60-120 s


@dataclass(frozen=True)
class JudgeServer:
    """How the judge is served: the vLLM server's options (module docstring), resolved from the config."""

    model_dir: str
    served_names: tuple[str, ...]
    device: str  # "cpu" or "cuda"
    dtype: str = "bfloat16"
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    max_model_len: int = 4096
    max_num_seqs: int = 1024
    max_num_batched_tokens: int = 8192
    gpu_memory_utilization: float = 0.5
    kv_cache_memory_bytes: int = CPU_DEFAULT_KV_BYTES
    enforce_eager: bool = True
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    disable_log_stats: bool = True
    seed: int = 42
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def command(self, port: int, host: str = "127.0.0.1") -> list[str]:
        """The server's command line (vLLM's ``api_server`` in this interpreter)."""
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
               "--served-model-name", *self.served_names, "--host", host, "--port", str(port),
               "--dtype", self.dtype, "--tensor-parallel-size", str(self.tensor_parallel_size),
               "--data-parallel-size", str(self.data_parallel_size), "--max-model-len", str(self.max_model_len),
               "--max-num-seqs", str(self.max_num_seqs), "--max-num-batched-tokens", str(self.max_num_batched_tokens),
               "--seed", str(self.seed),
               "--enable-chunked-prefill" if self.enable_chunked_prefill else "--no-enable-chunked-prefill",
               "--enable-prefix-caching" if self.enable_prefix_caching else "--no-enable-prefix-caching"]
        if self.device == "cpu":
            cmd += ["--kv-cache-memory-bytes", str(self.kv_cache_memory_bytes)]
        else:
            cmd += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        if self.disable_log_stats:
            cmd.append("--disable-log-stats")
        for name, value in self.engine_kwargs.items():
            flag = "--" + str(name).replace("_", "-")
            if value is True:
                cmd.append(flag)
            elif value is not False and value is not None:
                cmd += [flag, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
        return cmd


@refusal("model", "reward_model.rollout", "reward_model.model.path")
def served_judge(c: Checked) -> list[str]:
    """A generative reward model's server must start as configured: ``judge_problems``."""
    return judge_problems(c.cfg) if c.plan.reward_judge else []


def judge_problems(cfg) -> list[str]:
    """What stops the judge's server from starting as configured (empty: it can)."""
    values, problems = judge_rollout(cfg)
    key = "reward_model.rollout"
    if values["name"] not in (None, "vllm"):
        problems.append(f"{key}.name={values['name']}: meshrl serves a generative reward model with vLLM only")
    if values["skip_tokenizer_init"]:
        problems.append(f"{key}.skip_tokenizer_init=True: the judge's chat endpoint renders prompts with its "
                        "tokenizer; set it to False")
    if values["load_format"] not in LOAD_FORMATS:
        problems.append(f"{key}.load_format={values['load_format']}: the judge must load its trained weights "
                        f"({' or '.join(LOAD_FORMATS)})")
    if values["expert_parallel_size"] != 1:
        problems.append(f"{key}.expert_parallel_size={values['expert_parallel_size']}: expert parallelism of the "
                        "judge's server is not built yet; set 1")
    for name in ("tensor_model_parallel_size", "data_parallel_size", "max_num_seqs", "max_num_batched_tokens",
                 "prompt_length", "response_length"):
        if values[name] < 1:
            problems.append(f"{key}.{name}={values[name]}: must be >= 1")
    if values["kv_cache_memory_bytes"] is not None and values["kv_cache_memory_bytes"] <= 0:
        problems.append(f"{key}.kv_cache_memory_bytes={values['kv_cache_memory_bytes']}: must be > 0 (null: 1 GiB)")
    unknown = sorted(set(values["engine_kwargs"]) - {"vllm"})
    if unknown:
        problems.append(f"{key}.engine_kwargs: only the 'vllm' entry configures the judge's server, got {unknown}")
    return problems


def judge_server(cfg, model_dir: str | Path) -> JudgeServer:
    """The judge's server settings from ``cfg`` (checked by :func:`judge_problems` first)."""
    values, _ = judge_rollout(cfg)
    names = tuple(dict.fromkeys([str(cfg.reward_model.model.path), str(model_dir)]))
    return JudgeServer(
        model_dir=str(model_dir), served_names=names, device="cpu" if cfg.trainer.device == "cpu" else "cuda",
        dtype=values["dtype"], tensor_parallel_size=values["tensor_model_parallel_size"],
        data_parallel_size=values["data_parallel_size"],
        max_model_len=values["max_model_len"] or values["prompt_length"] + values["response_length"],
        max_num_seqs=values["max_num_seqs"], max_num_batched_tokens=values["max_num_batched_tokens"],
        gpu_memory_utilization=values["gpu_memory_utilization"],
        kv_cache_memory_bytes=values["kv_cache_memory_bytes"] or CPU_DEFAULT_KV_BYTES,
        enforce_eager=values["enforce_eager"], enable_chunked_prefill=values["enable_chunked_prefill"],
        enable_prefix_caching=values["enable_prefix_caching"], disable_log_stats=values["disable_log_stats"],
        seed=values["seed"], engine_kwargs=dict(values["engine_kwargs"].get("vllm") or {}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(address: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{address}/health", timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def serve_judge(server: JudgeServer, log_file: Path, start_timeout_s: float = START_TIMEOUT_S,
                say: Callable[[str], None] = print, port: int = 0) -> Iterator[str]:
    """Start the judge's server (its output in ``log_file``; on ``port``, 0: a free one), yield its ``host:port``
    once ``/health`` answers,
    and stop it on leaving, whatever ends the block: SIGTERM, then SIGKILL of its whole process group (vLLM's
    engine processes) after 30 s, then the shared memory vLLM's force-killed processes left (message queues,
    semaphores), so nothing is left behind. A server that exits or stays silent past
    ``start_timeout_s`` raises ``RuntimeError`` naming its log."""
    from meshrl.runtime import configure_environment, remove_orphaned_shared_memory, shm_names

    configure_environment()
    before = shm_names()
    port = port or _free_port()
    address = f"127.0.0.1:{port}"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as log:
        proc = subprocess.Popen(server.command(port), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ,
                                     "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")})
    try:
        start, deadline = time.monotonic(), time.monotonic() + start_timeout_s
        while not _healthy(address):
            if proc.poll() is not None:
                raise RuntimeError(f"the reward model's vLLM server exited with code {proc.returncode} while "
                                   f"starting; its log: {log_file}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the reward model's vLLM server did not answer within {start_timeout_s:.0f} s; "
                                   f"its log: {log_file}")
            time.sleep(1.0)
        say(f"meshrl: the reward model {server.served_names[0]} is served at {address} (vLLM, "
            f"{time.monotonic() - start:.0f} s to start; log: {log_file})")
        yield address
    finally:
        stop_process_group(proc)
        # vLLM's server force-kills its engine core and worker on the way out (CPU): their shared memory stays
        remove_orphaned_shared_memory(shm_names() - before)


def stop_process_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM ``proc`` (the leader of its own session); after ``grace_s`` or once it exits, SIGKILL whatever
    of its group is left."""
    if proc.poll() is None:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


async def chat_complete(router_address: str, request: Mapping[str, Any], timeout_s: float | None = None) -> dict:
    """POST ``request`` (OpenAI chat-completion fields: ``messages``, ``temperature``, ``max_tokens``, ...) to the
    judge at ``router_address``; the response as a dict (``["choices"][0]["message"]["content"]`` is the text).
    Raises ``RuntimeError`` with the server's message on an HTTP error."""
    import aiohttp

    url = f"http://{router_address}/v1/chat/completions"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        async with session.post(url, json=dict(request)) as response:
            body = await response.text()
            if response.status != 200:
                raise RuntimeError(f"the judge at {router_address} answered {response.status}: {body[:500]}")
            return json.loads(body)


def accepts_judge_arguments(fn: Callable) -> bool:
    """Whether ``fn`` can be called with verl's judge arguments (named, or through ``**kwargs``)."""
    import inspect

    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True  # no introspectable signature: trust it
    names = {p.name for p in params}
    return any(p.kind is p.VAR_KEYWORD for p in params) or all(a in names for a in JUDGE_ARGUMENTS)


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m meshrl.rewards.judge")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="serve a judge model until SIGTERM/SIGINT")
    p.add_argument("--model", required=True, help="a local HF folder or embedded:/tiny: name")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (printed)")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--dtype", default="float32" if not _cuda() else "bfloat16")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--log", default="judge-server.log")
    args = parser.parse_args(argv)
    from meshrl.models.resolve import resolve_model_path

    folder = str(resolve_model_path(args.model))
    server = JudgeServer(model_dir=folder, served_names=tuple(dict.fromkeys([args.model, folder])),
                         device="cuda" if _cuda() else "cpu", dtype=args.dtype,
                         tensor_parallel_size=args.tensor_parallel_size, max_model_len=args.max_model_len)
    with serve_judge(server, Path(args.log), say=print, port=args.port):
        with contextlib.suppress(KeyboardInterrupt):
            signal.signal(signal.SIGTERM, _interrupt)  # stop as on Ctrl-C: the server goes down with us
            signal.pause()
    return 0


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def _cuda() -> bool:
    from meshrl.runtime import has_cuda

    return has_cuda()


if __name__ == "__main__":
    sys.exit(main())
