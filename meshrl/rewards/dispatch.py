"""Reward function selection: built-in rule rewards by ``data_source``, or a custom function from a file.

The ``data_source`` argument is the value of the dataset column ``data.reward_fn_key`` names (verl's key;
``data_source`` by default), so a dataset can pick its rewards by another column, e.g. ``ability``.

Built-in dispatch (the ``data_source`` names verl's preprocess scripts write, plus short aliases):

- GSM8K: ``openai/gsm8k``, ``gsm8k`` -> :func:`meshrl.rewards.gsm8k.compute_score` (strict "####").
- MAWPS: ``mawps`` -> :func:`meshrl.rewards.gsm8k.compute_score` with ``method="flexible"`` (the last
  number in the response), compared numerically. MAWPS is the task a small model (SmolLM2-135M) can
  visibly learn in a few RL steps; such a model often gets the arithmetic right but rarely ends with
  "#### <n>" even when asked, so strict extraction would score almost every rollout 0 and leave no
  reward signal. Flexible extraction still reads "#### 43" (its last number is 43); the price is that
  a correct answer followed by another number (e.g. a unit such as "m2") scores 0. The comparison is
  numeric, so "43.0" or "43.00" match the ground truth "43".
- Generated tasks (:mod:`meshrl.data.generated`): ``reasoning_gym/<generator>`` -> the MAWPS rule (last
  number, numeric). Only generators with numeric answers are registered there.
- MATH: ``DigitalLearningGmbH/MATH-lighteval``, ``lighteval/MATH``, ``HuggingFaceH4/MATH-500``,
  ``math``, ``math500`` -> :func:`meshrl.rewards.math.judge` (math-verify).
- Geometry3K: ``hiyouga/geometry3k`` -> :func:`meshrl.rewards.geo3k.compute_score` (verl's: boxed answer, 0.1 for
  the ``<think>`` format).
- Code: ``codecontests``, ``apps``, ``codeforces``, ``taco`` (verl's) and ``openai/openai_humaneval``
  -> :func:`meshrl.rewards.code.compute_score`: the response's program against the row's test cases in
  the sandbox at ``sandbox_fusion_url`` (verl's argument; ``reward_model.sandbox_fusion.*``).

A custom reward (``custom_reward_function.path`` / ``.name`` in the config, as in verl) is a Python
file defining ``compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)``
returning a float, or a dict with a ``"score"`` key whose other entries are reported per sample.
``reward_kwargs`` are passed as keyword arguments on every call. The function may be ``async def`` (verl's
form for calls to a service: meshrl's pool runs such calls concurrently). With a generative reward model (a judge
served by vLLM, ``meshrl.rewards.judge``) every call also gets ``reward_router_address`` and
``reward_model_tokenizer``, as in verl.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshrl.rewards import code, geo3k, gsm8k
from meshrl.rewards import math as math_reward

RewardOutput = float | dict[str, Any]
RewardFn = Callable[..., RewardOutput]

GSM8K_SOURCES = frozenset({"openai/gsm8k", "gsm8k"})
MAWPS_SOURCES = frozenset({"mawps"})
# Tasks generated with reasoning-gym (meshrl.data.generated) name their source with this prefix; scored
# like MAWPS, on the response's last number.
DATA_SOURCE_PREFIX = "reasoning_gym/"
MATH_SOURCES = frozenset(
    {"DigitalLearningGmbH/MATH-lighteval", "lighteval/MATH", "HuggingFaceH4/MATH-500", "math", "math500"}
)
# verl's reward managers meshrl's pool is: "naive" scores each response with the function, "prime" does
# the same in parallel processes with a per-call timeout and 0 for a failed call, which the pool does for both;
# "gdpo" is naive's scoring too, whose dict-valued scores' other entries (the reward components gdpo's
# estimator normalises, algorithm.gdpo_reward_keys) the pool keeps per response for every manager; "dapo" is
# naive's scoring plus DAPO's overlong penalty, which the trainer adds (meshrl.rewards.overlong).
REWARD_MANAGERS = ("naive", "prime", "gdpo", "dapo")


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: Mapping[str, Any] | None = None,
    sandbox_fusion_url: str | None = None, concurrent_semaphore=None, memory_limit_mb: int = 1024,
    code_case_timeout_s: float = code.CASE_TIMEOUT_S, **rule_kwargs: Any,
) -> RewardOutput:
    """Built-in reward chosen by ``data_source`` (verl's signature, plus the code cases' time limit).

    GSM8K and MAWPS return a float; MATH returns ``{"score", "math_verify_fallback"}`` so that fallbacks to
    string comparison are counted; code returns ``{"score", "reward_error"}`` (:mod:`meshrl.rewards.code`).
    ``rule_kwargs`` (``custom_reward_function.reward_kwargs`` when no custom path is set) go to the
    GSM8K/MAWPS rule, e.g. ``{method: strict, format_score: 0.1}`` (verl's partial credit for a well-formed
    but wrong answer).

    Raises:
        NotImplementedError: unknown ``data_source`` (the message says how to plug in a custom reward).
        ValueError: a code source without ``sandbox_fusion_url`` (verl would run it unsandboxed in-process).
    """
    if data_source in code.CODE_SOURCES:
        if not sandbox_fusion_url:
            raise ValueError(f"data_source={data_source!r} is scored by running the response's code, which needs a "
                             "sandbox: pass sandbox_fusion_url (reward_model.sandbox_fusion.url; a training run "
                             "starts a local one when it is null)")
        return code.compute_score(data_source, solution_str, ground_truth, extra_info,
                                  sandbox_fusion_url=sandbox_fusion_url, concurrent_semaphore=concurrent_semaphore,
                                  memory_limit_mb=memory_limit_mb, timeout=code_case_timeout_s)
    if data_source in GSM8K_SOURCES:
        return gsm8k.compute_score(solution_str, ground_truth, **rule_kwargs)
    if data_source in MAWPS_SOURCES or data_source.startswith(DATA_SOURCE_PREFIX):
        return gsm8k.compute_score(solution_str, ground_truth, **{"method": "flexible", **rule_kwargs})
    if data_source in MATH_SOURCES:
        verdict = math_reward.judge(solution_str, ground_truth)
        return {"score": verdict.score, "math_verify_fallback": verdict.math_verify_fallback}
    if data_source in geo3k.GEO3K_SOURCES:
        return geo3k.compute_score(solution_str, ground_truth, **rule_kwargs)
    known = ", ".join(sorted(GSM8K_SOURCES | MAWPS_SOURCES | MATH_SOURCES | code.CODE_SOURCES | geo3k.GEO3K_SOURCES
                             | {DATA_SOURCE_PREFIX + "*"}))
    raise NotImplementedError(
        f"No built-in reward for data_source={data_source!r} (built-in: {known}). Write a "
        f"compute_score(data_source, solution_str, ground_truth, extra_info=None) function and point "
        f"custom_reward_function.path (and .name) at it."
    )


def load_custom_reward_function(path: str | Path, name: str = "compute_score") -> RewardFn:
    """Load function ``name`` from the Python file ``path`` and check that it takes verl's arguments.

    Raises:
        FileNotFoundError: no such file.
        AttributeError: the file defines no callable ``name`` (the message lists those it does define).
        TypeError: the function cannot be called as ``fn(data_source, solution_str, ground_truth, extra_info)``.
    """
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise FileNotFoundError(f"custom_reward_function.path={str(path)!r}: no such file ({file})")
    # A distinct module name per file keeps two custom reward files from shadowing each other.
    module_name = f"meshrl_custom_reward_{hashlib.sha1(str(file).encode()).hexdigest()[:12]}"
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, file)
        if spec is None or spec.loader is None:
            raise ImportError(f"custom_reward_function.path={str(path)!r} is not a loadable Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
    fn = getattr(module, name, None)
    if not callable(fn):
        defined = sorted(
            k for k, v in vars(module).items() if callable(v) and getattr(v, "__module__", None) == module_name
        )
        raise AttributeError(
            f"custom_reward_function.name={name!r} is not a function in {file}; functions defined there: "
            f"{defined or 'none'}"
        )
    try:
        inspect.signature(fn).bind("data_source", "solution_str", "ground_truth", None)
    except TypeError as e:
        raise TypeError(
            f"{file}:{name} must accept (data_source, solution_str, ground_truth, extra_info=None): {e}"
        ) from None
    except ValueError:
        pass  # builtins without an introspectable signature: trust them
    return fn


@dataclass(frozen=True)
class SandboxSettings:
    """Where and how code sources run (``reward_model.sandbox_fusion.*``; ``case_timeout_s``:
    :func:`meshrl.rewards.code.case_timeout`)."""

    url: str
    max_concurrent: int = 64
    memory_limit_mb: int = 1024
    case_timeout_s: float = code.CASE_TIMEOUT_S


@dataclass(frozen=True)
class JudgeSettings:
    """Where the generative reward model answers (``host:port``) and the folder of its tokenizer."""

    address: str
    tokenizer_path: str


@dataclass(frozen=True)
class RewardSpec:
    """Picklable description of the reward function, so that worker processes can rebuild it.

    ``custom_path`` None selects :func:`default_compute_score`; ``reward_kwargs`` are passed to every call;
    ``sandbox`` is where the built-in reward runs code sources (None: the run has none to score); ``judge``: the
    generative reward model the custom function asks (verl's ``reward_router_address`` and
    ``reward_model_tokenizer`` arguments on every call), None: none.
    """

    custom_path: str | None = None
    custom_name: str = "compute_score"
    reward_kwargs: Mapping[str, Any] = field(default_factory=dict)
    sandbox: SandboxSettings | None = None
    judge: JudgeSettings | None = None

    @property
    def label(self) -> str:
        """The function as messages name it: ``name (file)`` for a custom one, else the built-in dispatch."""
        if self.custom_path:
            return f"reward function {self.custom_name} ({Path(self.custom_path).expanduser().resolve()})"
        return "built-in reward (meshrl.rewards.dispatch.default_compute_score)"

    def build(self, concurrent_semaphore=None) -> RewardFn:
        """The callable ``fn(data_source, solution_str, ground_truth, extra_info)``. ``concurrent_semaphore``
        bounds the sandbox requests in flight across every process holding it (verl's argument)."""
        if self.custom_path:
            fn = load_custom_reward_function(self.custom_path, self.custom_name)
        elif self.sandbox is not None:
            fn = functools.partial(default_compute_score, sandbox_fusion_url=self.sandbox.url,
                                   concurrent_semaphore=concurrent_semaphore,
                                   memory_limit_mb=self.sandbox.memory_limit_mb,
                                   code_case_timeout_s=self.sandbox.case_timeout_s)
        else:
            fn = default_compute_score
        kwargs = dict(self.reward_kwargs)
        if self.judge is not None:
            from transformers import AutoTokenizer

            kwargs.update(reward_router_address=self.judge.address,
                          reward_model_tokenizer=AutoTokenizer.from_pretrained(self.judge.tokenizer_path))
        return functools.partial(fn, **kwargs) if kwargs else fn
