"""No config key is accepted and silently ignored (``meshrl.config.key_policy``).

The walk covers every key of the schema: a key is refused, FSDP-only or inert by the policy's tables (and then
setting it away from its default must refuse or warn, naming it), or meshrl reads it.

"Reads" means: meshrl's code reads the key by its full dotted path. ``meshrl.config.reads`` records every read of
the config, with its path and its reader, while a few configs (``CONFIGS``, which between them switch on every
role and every feature whose keys are read only when it is on) go through all that a run does with its config:
``load_config``'s check of the training backend, ``preflight``, ``load_inputs``, and ``run`` itself: the driver,
its worker groups' handles, the RL loop, and each worker's construction and ``setup`` from the section the driver
hands it. Two things are replaced, so that this stays a fast unit test: Ray's actors, by in-process ones that answer
the step calls with results of the right shapes, and what a worker's set-up imports (models, optimizers, engines,
megatron), by stand-ins, so that what is left of a set-up is its reading of its own section (and the translators
it calls, ``meshrl.config.*`` and ``meshrl.rollout.base``). A key read only by the actor's set-up thus does not
count for the critic's key of the same name (``critic.megatron.seed`` is read by the critic's set-up).

A check that refuses some values of a key reads it (``validate_config``: ``optim.num_cycles`` other than 0.5 stops
the run). Not reads: functions that read every key of a section to compare it with its default (``WALKS``), which
would count any key. A key whose value reaches the code through another key (``${...}`` in that key's schema
default, or the judge's two homes) is read when that key is (``followers``).
"""

import builtins
import contextlib
import functools
import json
import re
import threading
from types import SimpleNamespace
from unittest import mock

import pytest
import ray
import torch
from omegaconf import OmegaConf

import meshrl.rewards.judge
import meshrl.workers.cluster
import meshrl.workers.group
import meshrl.workers.rank
from meshrl.config import ConfigError, load_config
from verl_scripts.classify import converted_checkpoint
from meshrl.config.key_policy import classify, leaf_keys
from meshrl.config.loader import _check_model_engine, default_config
from meshrl.config.reads import ConfigReads, recording
from meshrl.config.reward_model_kind import JUDGE_SECTIONS
from meshrl.config.schema import RewardModelRolloutConfig
from meshrl.config.validate import validate_config
from meshrl.protocol import Batch
from meshrl.rollout.base import Completion
from meshrl.trainer.main import load_inputs, preflight, run
from meshrl.workers.sequences import responses_batch

DEFAULTS = default_config()  # read only
KEYS = leaf_keys(DEFAULTS)

# Readers that read every key of a section, whatever the run uses, to compare it with its default: their reads say
# nothing about a key being used.
WALKS = ("meshrl.config.key_policy.",  # each key set away from its default: refused, warned about or read
         "meshrl.config.reward_model_kind._changed",  # the judge's server keys set in either home
         "meshrl.config.lora_keys._other_spelling")  # the keys of the LoRA spelling a run does not use

# The configs whose runs read every key (cpu_tiny_grpo with these overrides; {tmp} is the data folder). They
# switch on each role (critic, reference, reward model, judge) and each feature whose keys are read only when it
# is on (multi-turn tools and interactions, async rollout, LoRA in both of verl's spellings, megatron
# checkpoints as the starting weights).
CONFIGS = {
    "ppo_reference_multi_turn_megatron_checkpoints": [
        "algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_kl_loss=True",
        *(f"{role}.megatron.{key}" for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")
          for key in ("use_dist_checkpointing=True", "dist_checkpointing_path={tmp}/mcore")),
        "actor_rollout_ref.rollout.mode=async", "actor_rollout_ref.rollout.multi_turn.enable=True",
        "actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp}/tools.yaml",
        "actor_rollout_ref.rollout.multi_turn.function_tool_path={tmp}/function_tools.py",
        "actor_rollout_ref.rollout.multi_turn.interaction_config_path={tmp}/interactions.yaml"],
    "reward_model_peft_lora_fully_async": [
        "reward_model.enable=True", "reward_model.model.path=tiny-rm:llama",
        "actor_rollout_ref.model.lora_adapter_path={tmp}/adapter", "trainer.async_mode=fully_async",
        "algorithm.rollout_correction.bypass_mode=True", "async_training.require_batches=2"],
    "judge_megatron_lora": [
        "reward_model.enable=True", "reward_model.model.path=tiny:llama",
        "custom_reward_function.path={tmp}/judged_reward.py", "actor_rollout_ref.model.lora.rank=8"],
}

# Prompts naming their interaction (as rows must with interaction_config_path)
ROWS = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
         "reward_model": {"ground_truth": str(i + 1)},
         "extra_info": {"index": i, "interaction_kwargs": {"name": "gsm8k"}}} for i in range(6)]
# The files CONFIGS name: data, a tool of each kind, an interaction, a judge's reward function, a PEFT adapter
FILES = {
    "tools.yaml": "tools:\n  - class_name: verl.tools.gsm8k_tool.Gsm8kTool\n    config: {type: native}\n"
                  "    tool_schema: {type: function, function: {name: calc_gsm8k_reward,\n"
                  "                                             parameters: {type: object}}}\n",
    "function_tools.py": 'from meshrl.rollout.tools.function import function_tool\n\n\n@function_tool\n'
                         'def add(a: int) -> int:\n    """Add one.\n\n    Args:\n        a: a number\n    """\n'
                         '    return a + 1\n',
    "interactions.yaml": "interaction:\n  - name: gsm8k\n    class_name: verl.interactions.gsm8k_interaction."
                         "Gsm8kInteraction\n    config: {}\n",
    "judged_reward.py": "def compute_score(data_source, solution_str, ground_truth, extra_info=None,\n"
                        "                  reward_router_address=None, reward_model_tokenizer=None):\n    return 0.0\n",
    "adapter/adapter_config.json": json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16,
                                               "target_modules": ["q_proj", "v_proj"]}),
    "train.jsonl": "".join(json.dumps(row) + "\n" for row in ROWS[:4]),
    "val.jsonl": "".join(json.dumps(row) + "\n" for row in ROWS[4:]),
}


class StandIn(mock.MagicMock):
    """What a worker's set-up gets for each name it imports (a model builder, an engine, megatron...): every
    attribute and call result a stand-in too; one unpacks as a pair (``build_optimizer``'s optimizer and scheduler)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.__iter__.side_effect = lambda: iter((StandIn(), StandIn()))

    def _get_child_mock(self, **kwargs):
        # magic methods stay MagicMock's (a StandIn's own __iter__ would be one more StandIn, without end)
        return mock.MagicMock(**kwargs) if kwargs.get("_new_name", "").startswith("__") else StandIn(**kwargs)


WORKER_MODULES = ("meshrl.workers.actor_rollout_ref", "meshrl.workers.critic", "meshrl.workers.reward_model",
                  "meshrl.workers.rank", "meshrl.workers.model_setup")
# What a set-up imports and runs for real: the translations of its section (optimizer, engine and sampling settings)
REAL_IMPORTS = ("meshrl.config", "meshrl.rollout.base")


@contextlib.contextmanager
def stood_in_imports():
    """Inside the block, an import made by a worker module gives a ``StandIn`` (but ``REAL_IMPORTS``), and the
    environment a rank sets for its rendezvous is put back after it."""
    real = builtins.__import__

    def stand_in(name, globals=None, locals=None, fromlist=(), level=0):
        if (globals or {}).get("__name__") in WORKER_MODULES and not name.startswith(REAL_IMPORTS):
            return StandIn(name=name)
        return real(name, globals, locals, fromlist, level)

    with mock.patch.object(builtins, "__import__", stand_in), mock.patch.dict("os.environ"):
        yield


# The run starts its groups on threads of its own (meshrl.trainer.worker_start), each normally in its own processes.
SETUP_LOCK = threading.Lock()


class InProcessGroup:
    """``meshrl.workers.group.WorkerGroup`` without Ray: rank 0's worker, built in this process from what the
    driver hands it (its section, tracked under the section's key), set up with its imports stood in; the step
    calls get results of the shapes the driver expects (``canned``)."""

    def __init__(self, reads: ConfigReads, worker_cls, world_size: int, *, init_kwargs, **ray_options) -> None:
        self.worker = worker_cls(0, world_size, **init_kwargs)
        reads.track(self.worker.section, prefix=worker_cls.SECTION)
        self.workers = [SimpleNamespace(address=SimpleNamespace(remote=self.worker.address))]  # ray.get: the value

    def call(self, method: str, *args, **kwargs) -> list:
        return self.call_per_rank(method, [args], **kwargs)

    def call_per_rank(self, method: str, per_rank: list[tuple], **kwargs) -> list:
        (args,) = per_rank
        if method not in ("setup", "start_engine"):
            return [canned(self.worker, method, *args, **kwargs)]
        with SETUP_LOCK, stood_in_imports():  # one at a time: the groups share this process's Megatron state
            started = getattr(self.worker, method)(*args, **kwargs)
            if method == "start_engine":  # the policy's engine, once every group is set up
                return [started]
            if hasattr(self.worker, "_offload_hooks"):  # the policy's offload keys, read by each (canned) rollout
                self.worker._offload_hooks()
        return [{"rank": 0, "dp_rank": 0, "dp_size": 1, "collect": True, "replica": 0, "replica_leader": True,
                 "num_replicas": 1}]

    def shutdown(self) -> None:
        pass


def canned(worker, method: str, *args, **kwargs):
    """A step call's result as a worker returns it: two-token responses, ``n`` per prompt as the worker's set-up
    decided; zero log-probs (those of the responses too, so that the mismatch alarm passes), values and scores."""
    if method == "generate":
        (prompts,), n = args, worker.sampling[kwargs["mode"]].n
        completions = [Completion(p, s, [7, 8], [0.0, 0.0], "stop") for p in range(len(prompts)) for s in range(n)]
        return responses_batch(prompts, completions, n, worker.response_length, pad_id=0)
    if method == "start_generate":  # the asynchronous trainers' rollouter: generate's result, given by finish_generate
        worker.canned_generation = canned(worker, "generate", *args, **kwargs)
        return None
    if method == "finish_generate":
        return worker.canned_generation
    # the fully async rollouter's partial rollout (stream_submit, stream_start): every group submitted finishes
    if method == "stream_submit":
        worker.canned_keys = getattr(worker, "canned_keys", []) + list(args[1])
        return None
    if method == "stream_finish":
        keys, worker.canned_keys = getattr(worker, "canned_keys", []), []
        return keys
    if method == "stream_take":
        return canned(worker, "generate", args[0], mode="train")
    if method == "compute_log_probs":
        field = "ref_log_probs" if kwargs["model"] == "ref" else "old_log_probs"
        return Batch(tensors={field: torch.zeros(args[0]["responses"].shape)})
    if method == "compute_values":
        return Batch(tensors={"values": torch.zeros(args[0]["responses"].shape)})
    if method == "compute_scores":
        return Batch(tensors={"rm_scores": torch.zeros(len(args[0]["responses"]))})
    if method == "update":  # metrics; the policy's also no log-probs: none of CONFIGS updates on-policy
        return {} if worker.SECTION == "critic" else ({}, None)
    return {} if method == "sync_weights" else None  # the other calls (checkpoints) return nothing


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A folder holding ``FILES``."""
    folder = tmp_path_factory.mktemp("key_policy")
    for name, text in FILES.items():
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_text(text)
    (folder / "mcore").symlink_to(converted_checkpoint())  # the Megatron checkpoint CONFIGS start from
    return folder


def recorded_reads(overrides: list[str], folder, run_dir) -> ConfigReads:
    """The reads of a run of ``overrides`` (module docstring) on ``folder``'s files, in ``run_dir``. Its rewards are
    scored in this process and its metrics go to the console only (no closing plot to draw)."""
    cfg = load_config([f"data.train_files={folder}/train.jsonl", f"data.val_files={folder}/val.jsonl",
                       f"trainer.default_local_dir={run_dir}", "reward_model.num_workers=0", "trainer.logger=[console]",
                       *(item.format(tmp=folder) for item in overrides)], recipe="cpu_tiny_grpo")
    judge_rollout = meshrl.rewards.judge.judge_rollout
    with recording() as reads, contextlib.ExitStack() as patches:

        def recorded_judge_rollout(cfg):
            # The judge's server settings are read from this plain dict, which holds their older home's values.
            values, problems = judge_rollout(cfg)
            return reads.track_dict(values, JUDGE_SECTIONS[0]), problems

        for target, name, value in [
                (meshrl.workers.group, "WorkerGroup", functools.partial(InProcessGroup, reads)),
                (meshrl.workers.cluster, "start_ray", lambda cfg: None),
                (ray, "get", lambda value, timeout=None: value), (ray, "put", lambda value: value),
                # the test process's own environment and allocator stay as they are
                (meshrl.workers.rank, "configure_environment", lambda: None),
                (meshrl.workers.rank, "limit_heap_growth", lambda: None),
                (meshrl.rewards.judge, "judge_rollout", recorded_judge_rollout),
                (meshrl.rewards.judge, "serve_judge", lambda *args, **kwargs: contextlib.nullcontext("127.0.0.1:1"))]:
            patches.enter_context(mock.patch.object(target, name, value))
        reads.track(cfg)
        _check_model_engine(cfg)  # the one read load_config makes to use a key (its other reads set the keys)
        plan = preflight(cfg)
        run(cfg, plan, load_inputs(cfg))
    return reads


def followers() -> dict[str, set[str]]:
    """key -> the keys through which its value reaches the code: those whose schema default is ``${key}`` (or holds
    it), resolved at load; and for ``reward.reward_model.rollout.*``, the judge's older home, which
    ``meshrl.config.reward_model_kind.judge_rollout`` fills from it unless set itself."""
    defaults, out = default_config(), {}
    for key in KEYS:
        parent, _, leaf = key.rpartition(".")
        node = (OmegaConf.select(defaults, parent) if parent else defaults)._get_node(leaf)
        if node._is_interpolation():
            for target in re.findall(r"\$\{([^}]+)\}", node._value()):
                followed = f"{parent}{target}" if target.startswith(".") else target  # relative: a sibling's
                out.setdefault(followed, set()).add(key)
    for name in RewardModelRolloutConfig.__dataclass_fields__:
        out.setdefault(f"{JUDGE_SECTIONS[1]}.{name}", set()).add(f"{JUDGE_SECTIONS[0]}.{name}")
    return out


@pytest.fixture(scope="module")
def read_keys(data_dir, tmp_path_factory) -> set[str]:
    """Every key meshrl's code reads, but for ``WALKS``, in one of ``CONFIGS``' runs."""
    read = set()
    for name, overrides in CONFIGS.items():
        reads = recorded_reads(overrides, data_dir, tmp_path_factory.mktemp(name))
        read |= {path for path, readers in reads.paths.items()
                 if any(r.startswith("meshrl.") and not r.startswith(WALKS) for r in readers)}
    return read


def test_every_schema_key_is_read_refused_or_warned(read_keys):
    follow = followers()

    def is_read(key: str) -> bool:
        return key in read_keys or any(is_read(k) for k in follow.get(key, ()))

    unread = [key for key in KEYS if classify(key) == "read" and not is_read(key)]
    assert not unread, ("keys that no code of meshrl reads by their full path (in this test's runs) and that "
                        "meshrl.config.key_policy's tables do not refuse or warn about: " + ", ".join(unread))


def test_the_recorder_names_full_paths_of_tracked_trees_only():
    cfg, defaults = load_config([], recipe="cpu_tiny_grpo"), default_config()
    section = OmegaConf.create(OmegaConf.to_container(cfg.critic))  # as a worker rebuilds its section
    with recording() as reads:
        reads.track(cfg)
        reads.track(section, prefix="critic")
        assert cfg.actor_rollout_ref.actor.megatron.seed == section.megatron["seed"] == 42
        OmegaConf.select(cfg, "trainer.seed")
        cfg.data.get("shuffle")
        dict(cfg.algorithm.kl_ctrl)
        list(cfg.algorithm.gpg.items())
        list(cfg.algorithm.remax.values())
        OmegaConf.to_container(cfg.reward_model)  # a copy reads no key in particular
        defaults.trainer.total_epochs  # not a tracked tree
        reads.track_dict({"dtype": "bfloat16"}, "reward_model.rollout")["dtype"]
    cfg.trainer.device  # after the block: nothing is recorded
    assert set(reads.paths) == {
        "actor_rollout_ref", "actor_rollout_ref.actor", "actor_rollout_ref.actor.megatron",
        "actor_rollout_ref.actor.megatron.seed", "critic.megatron", "critic.megatron.seed", "trainer.seed", "data",
        "data.shuffle", "algorithm", "algorithm.kl_ctrl", "algorithm.gpg", "reward_model", "reward_model.rollout.dtype",
        *(f"algorithm.kl_ctrl.{key}" for key in ("type", "kl_coef", "horizon", "target_kl")),
        "algorithm.gpg.alpha_mode", "algorithm.gpg.norm_by_std", "algorithm.remax", "algorithm.remax.reward_clip"}
    assert reads.paths["trainer.seed"] == {f"{__name__}.test_the_recorder_names_full_paths_of_tracked_trees_only"}


@functools.lru_cache(maxsize=1)
def recipe_config():
    """The config the key tests below start from."""
    return load_config([], recipe="cpu_tiny_grpo")


def other_value(key: str):
    """A value of the key's type other than its value in ``recipe_config`` (its default, or for verl's copy of another
    key, that key's value there)."""
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(DEFAULTS, parent)._get_node(leaf)
    default = OmegaConf.select(recipe_config(), key)
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default + 1
    if isinstance(default, str):
        return default + "_other"
    if "List" in str(node._metadata.ref_type):  # also an Optional[List[...]] left at None
        return [7] if node._metadata.element_type in (int, float) else ["other"]
    if default is None:
        return 7
    return {"other": 1}


def overrides_for(key: str) -> list[str]:
    value = other_value(key)
    if isinstance(value, dict):
        return [f"+{key}.other=1"]
    return [f"{key}={value if not isinstance(value, list) else '[' + ','.join(map(str, value)) + ']'}"]


@pytest.mark.parametrize("key", [k for k in KEYS if classify(k) == "refused"])
def test_a_refused_key_stops_at_config_time_naming_itself(key):
    try:
        cfg = load_config(overrides_for(key), recipe="cpu_tiny_grpo")
    except ConfigError as exc:  # a value of another type is refused by the loader, naming the key too
        assert key in str(exc)
        return
    with pytest.raises(ConfigError) as info:
        validate_config(cfg)
    assert key in str(info.value)


@pytest.mark.parametrize("key", [k for k in KEYS if classify(k) in ("fsdp_only", "inert")])
def test_an_fsdp_only_or_inert_key_loads_and_is_named_in_a_warning(key):
    try:
        cfg = load_config(overrides_for(key), recipe="cpu_tiny_grpo")
    except ConfigError:
        pytest.skip(f"{key}: the generated value is not of the key's type")
    plan = validate_config(cfg)
    assert any(key in warning for warning in plan.warnings), plan.warnings


def test_defaults_raise_no_warning():
    assert validate_config(load_config([], recipe="cpu_tiny_grpo")).warnings == ()
