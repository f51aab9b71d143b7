"""Rollout correction (verl's ``algorithm.rollout_correction``): importance-sampling (IS) weights and rejection
sampling (RS) of the trained tokens against the rollout engine's log-probs, verl's ``rollout_corr/*`` metrics,
and verl's ``bypass_mode`` policy loss. Pure tensor functions; the trainer's side is
``meshrl.trainer.rollout_correction``.

Notation, per token t of response i, m the response mask (valid tokens):

    δ_t  = logπ_train − logπ_rollout      the log-ratio; π_train is π_old (decoupled mode: the trainer's
                                          recomputed log-probs) or π_θ (bypass mode: the policy being trained)
    δ̄_t  = clamp(δ_t, −20, 20)            (``SAFETY_BOUND``)
    S_i  = Σ_t m·δ_t                      the response's log-ratio

**IS weights** (``rollout_is``), detached, 0 at masked tokens:

    token     w_t = exp(δ̄_t)
    sequence  w_t = exp(clamp(S_i, −20, 20))              the same weight on every token of response i

then ``rollout_is_threshold``: a number U (or a numeric string), truncated IS (TIS): w ← min(w, U); a string
"L_U", IcePop: w ← w·[L ≤ w ≤ U] (the mask is untouched). With ``rollout_is_batch_normalize``: w ← w / w̄ when
w̄ > 1e-8, w̄ = Σ w·m / Σ m (token) or the mean over responses with a valid token of Σ_t w·m / Σ_t m (sequence).
The policy loss is multiplied by w token by token (``meshrl.workers.objectives``).

**Rejection** (``rollout_rs``: options separated by commas, every one must pass; ``rollout_rs_threshold``: one
value for all, or one per option, comma-separated), on the per-token divergences

    k1 = −δ̄,   k2 = ½·δ̄²,   k3 = exp(δ̄) − 1 − δ̄

    token_k{1,2,3}      the token's own kN
    seq_sum_k{1,2,3}    Σ_t m·kN over the response;   seq_mean_k{1,2,3}: Σ_t m·kN / Σ_t m
    seq_max_k{2,3}      max of kN over the response's valid tokens (0 for an empty response)

A k1 statistic is kept when log L ≤ stat ≤ log U (threshold "L_U" in ratio space; U alone means L = 1/U);
a k2 / k3 statistic when stat ≤ U. As in verl, k1 is −δ (so "0.6_1.4" keeps δ in [−log 1.4, −log 0.6]). The
trained mask becomes m · Π_options keep; a sequence option keeps or drops the whole response.

**Batch statistics** (batch normalisation, every metric) are taken over the tensors passed in, as verl takes
them: in decoupled mode the trainer passes the whole RL batch (verl's driver does the same); in bypass mode the
loss sees one micro-batch (verl: one micro-batch per rank, the token-level normalisation all-reduced over
ranks; meshrl normalises over the micro-batch alone). "Over responses" means over every row of the batch,
empty ones included, unless said otherwise (verl's ``.mean()`` over the batch dimension).

**Metrics** (``rollout_corr/`` + name; token means are Σ x·m / Σ m over the response mask as given, before
rejection). IS, on the weights w before batch normalisation and w_raw before truncation (both ·m), with
U, L the thresholds (L = 1/U without IcePop):

    rollout_is_mean                    token mean of w
    rollout_is_max / _min              token: max / min of w over valid tokens;
                                       sequence: exp(min(max_i S_i, 20)) / exp(min_i S_i) (rows without tokens
                                       count with S = 0)
    rollout_is_ratio_fraction_high/low token: token mean of [w_raw > U] / [w_raw < L];
                                       sequence: mean over responses of [S_i > log U] / [S_i < log L]
    rollout_is_std                     sqrt(max(0, mean(c²) − mean(c)²)), c = clamp(w, 0, U), token means
                                       (0 with a single valid token)
    rollout_is_eff_sample_size         1 / token mean of (c / (mean(c) + 1e-8))²
    rollout_is_seq_mean/_std/_max/_min over responses of w̃_i = Σ_t w·m / Σ_t m (std: unbiased, 0 for one row)
    rollout_is_seq_max_deviation       max_i |w̃_i − 1|
    rollout_is_seq_fraction_high/low   mean over responses of [w̃_raw,i > U] / [w̃_raw,i < L]
    rollout_is_oob_ratio               IcePop only: token mean of [w_raw < L or w_raw > U]
    rollout_is_batch_norm_factor       with batch normalisation: w̄ (1.0 when w̄ ≤ 1e-8)

RS, per option o (prefix rollout_rs_<o>), with x the statistic per token (a sequence option's value on each
of its tokens), v_i the per-response value (a token option: Σ_t x·m / Σ_t m), over responses with a valid
token; thresholds in the statistic's space (k1: log L, log U; k2 / k3: U and 0):

    _mean                              token mean of x
    _max / _min                        sequence options: max / min of v; token options: over valid tokens of x
    _fraction_high / _fraction_low     sequence: mean of [v > U'] / [v < L']; token: token mean of [x > U'] /
                                       [x < L']; _fraction_low is 0 for k2 / k3
    _std                               as rollout_is_std, with x clamped to [L', U'] (k2 / k3: [0, U])
    _seq_mean/_seq_std/_seq_max/_seq_min/_seq_max_deviation (max |v|)/_seq_fraction_high (and, k1 only,
                                       _seq_fraction_low): over v
    _masked_fraction                   token mean of [rejected by o]
    _seq_masked_fraction               over responses with a valid token: [o rejects one of its tokens]
    rollout_rs_masked_fraction         token mean of [rejected by any option]
    rollout_rs_seq_masked_fraction     over all responses: [a valid token of it is rejected]

Off-policy diagnostics (``off_policy_metrics``), logged whenever both log-probs exist (not in bypass mode),
with l̄_i = Σ_t m·logπ / Σ_t m per response:

    training_ppl / rollout_ppl         mean over responses of exp(−l̄_i)   (_log_ppl: of −l̄_i)
    kl                                 token mean of logπ_rollout − logπ_train
    k3_kl                              token mean of exp(δ) − δ − 1
    log_ppl_diff (_abs_diff, _max, _min)  over responses of l̄_rollout,i − l̄_train,i (mean, mean |·|, max, min)
    ppl_ratio                          mean over responses of exp(l̄_rollout,i − l̄_train,i)
    chi2_token                         token mean of exp(δ̄)² − 1
    chi2_seq                           mean over responses of exp(2·clamp(S_i, −20, 20)) − 1

**Bypass mode** (``bypass_mode``, the loss verl's trainer switches to with ``rollout_correction.bypass_mode``):
old_log_prob is the engine's log-prob (no recompute). ``loss_type=ppo_clip``: PPO's clipped loss with the ratio
π_θ/π_rollout, no IS weights (the ratio already is one); ``reinforce``: L = −A·logπ·w (w = 1 without
``rollout_is``). Either way rejection narrows the loss mask. Its ``rollout_corr/*`` metrics are the token means
above (exact over the mini-batch, where verl averages micro-batch values); the others need whole-batch
reductions that additive metric shares cannot carry, and are not logged in bypass mode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from meshrl.algorithms.masked import masked_mean, masked_sum
from meshrl.algorithms.policy_loss import TokenLoss, _check_inputs, vanilla
from meshrl.algorithms.registry import register_policy_loss
from meshrl.algorithms.validation import check_has_valid_token, check_same_shape, response_mask_as_bool

SAFETY_BOUND = 20.0
IS_LEVELS = ("token", "sequence")
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
              "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
LOSS_TYPES = ("ppo_clip", "reinforce")
PREFIX = "rollout_corr/"


# ------------------------------------------------------------------------------------------------ settings
def parse_is_threshold(spec: Any) -> tuple[float, float | None]:
    """``rollout_is_threshold`` → (upper U, lower L or None): a number or numeric string is TIS's U, "L_U" IcePop's
    bounds. Raises ValueError on anything else, a bound ≤ 0, or L > U."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise ValueError(f"rollout_is_threshold must be a number or a 'lower_upper' string, got {spec!r}")
    lower = None
    text = str(spec).strip()
    try:
        if isinstance(spec, str) and "_" in text:
            low, high = text.split("_", 1)
            lower, upper = float(low), float(high)
        else:
            upper = float(text)
    except ValueError:
        raise ValueError(f"rollout_is_threshold {spec!r} is neither a number nor a 'lower_upper' pair") from None
    if not upper > 0 or lower is not None and not lower > 0:
        raise ValueError(f"rollout_is_threshold {spec!r}: bounds must be positive")
    if lower is not None and lower > upper:
        raise ValueError(f"rollout_is_threshold {spec!r}: the lower bound exceeds the upper one")
    return upper, lower


@dataclass(frozen=True)
class RejectionOption:
    """One ``rollout_rs`` option and its bounds: ``upper`` U, ``lower`` L (k1 options only), in ratio space for
    k1 (kept: log L ≤ stat ≤ log U), in the divergence's space for k2 / k3 (kept: stat ≤ U)."""

    name: str
    upper: float
    lower: float | None = None

    @property
    def sequence_level(self) -> bool:
        return not self.name.startswith("token_")

    @property
    def estimator(self) -> str:  # k1 | k2 | k3
        return self.name[-2:]

    def bounds(self) -> tuple[float, float]:
        """(lower, upper) in the statistic's own space: (log L, log U) for k1, (0, U) otherwise."""
        if self.lower is not None:
            return math.log(self.lower), math.log(self.upper)
        return 0.0, self.upper


def parse_rejection(rollout_rs: Any, threshold: Any) -> tuple[RejectionOption, ...]:
    """``rollout_rs`` / ``rollout_rs_threshold`` → the options, in order, duplicates dropped; () when rollout_rs is
    None. One threshold serves every option, or one per (distinct) option; a k1 threshold is "L_U" or U (L = 1/U),
    a k2 / k3 one a single positive U. Raises ValueError naming what is wrong."""
    if rollout_rs is None:
        return ()
    if not isinstance(rollout_rs, str):
        raise ValueError(f"rollout_rs must be a string of options separated by commas, got {rollout_rs!r}")
    names = list(dict.fromkeys(part.strip() for part in rollout_rs.split(",") if part.strip()))
    unknown = [name for name in names if name not in RS_OPTIONS]
    if not names or unknown:
        raise ValueError(f"rollout_rs {rollout_rs!r}: unknown option(s) {', '.join(unknown) or '(none given)'}; "
                         f"options: {', '.join(RS_OPTIONS)}")
    if threshold is None:
        raise ValueError("rollout_rs_threshold must be set when rollout_rs is")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float, str)):
        raise ValueError(f"rollout_rs_threshold must be a number or a string, got {threshold!r}")
    specs = [str(threshold)] if not isinstance(threshold, str) else \
        [part.strip() for part in threshold.split(",") if part.strip()]
    if len(specs) not in (1, len(names)):
        raise ValueError(f"rollout_rs_threshold {threshold!r}: give one threshold for all options or one per option "
                         f"({len(names)}: {', '.join(names)})")
    options = []
    for name, spec in zip(names, specs * len(names) if len(specs) == 1 else specs):
        try:
            if name.endswith("k1"):
                low, _, high = spec.partition("_") if "_" in spec else (None, "", spec)
                upper = float(high)
                lower = float(low) if low is not None else 1.0 / upper
            elif "_" in spec:
                raise ValueError(f"rollout_rs_threshold for {name} is an upper bound alone, got {spec!r}")
            else:
                upper, lower = float(spec), None
        except (ValueError, ZeroDivisionError) as error:
            raise ValueError(f"rollout_rs_threshold {spec!r} for {name}: {error}") from None
        if not upper > 0 or lower is not None and not lower > 0:
            raise ValueError(f"rollout_rs_threshold {spec!r} for {name}: bounds must be positive")
        if lower is not None and lower > upper:
            raise ValueError(f"rollout_rs_threshold {spec!r} for {name}: the lower bound exceeds the upper one")
        options.append(RejectionOption(name, upper, lower))
    return tuple(options)


@dataclass(frozen=True)
class RolloutCorrectionSettings:
    """``algorithm.rollout_correction``, checked and parsed (``from_config``); the defaults are verl's."""

    rollout_is: str | None = None  # None | token | sequence
    is_threshold: float = 2.0  # U
    is_threshold_lower: float | None = None  # IcePop's L; None: TIS
    batch_normalize: bool = False
    rejection: tuple[RejectionOption, ...] = ()
    bypass: bool = False  # old_log_probs := rollout_log_probs, loss bypass_mode
    loss_type: str = "ppo_clip"  # bypass mode's loss: ppo_clip | reinforce

    @classmethod
    def from_config(cls, section: Any) -> RolloutCorrectionSettings:
        """From the section's seven keys (verl's names); raises ValueError naming what is wrong."""
        rollout_is = section.rollout_is
        if rollout_is is not None and rollout_is not in IS_LEVELS:
            raise ValueError(f"rollout_is must be null, token or sequence, got {rollout_is!r}")
        threshold = section.rollout_is_threshold
        if rollout_is is not None and threshold is None:
            # verl then computes no weights at all, silently
            raise ValueError("rollout_is_threshold must be set when rollout_is is")
        upper, lower = parse_is_threshold(threshold) if threshold is not None else (2.0, None)
        if section.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {section.loss_type!r}")
        return cls(rollout_is=rollout_is, is_threshold=upper, is_threshold_lower=lower,
                   batch_normalize=bool(section.rollout_is_batch_normalize),
                   rejection=parse_rejection(section.rollout_rs, section.rollout_rs_threshold),
                   bypass=bool(section.bypass_mode), loss_type=section.loss_type)

    @property
    def corrects(self) -> bool:
        """IS weights or rejection are asked for (in decoupled mode: they need the old log-probs before the update)."""
        return self.rollout_is is not None or bool(self.rejection)


# ------------------------------------------------------------------------------------------------ weights
def _seq_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Per response Σ_t x·m / Σ_t m (0 for an empty response)."""
    return masked_mean(values, mask, -1)


def raw_weights(log_ratio: Tensor, mask: Tensor, level: str) -> Tensor:
    """The IS weights before truncation, 0 at masked tokens (token: exp(δ̄); sequence: exp(clamp(S_i)))."""
    if level == "token":
        weights = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    elif level == "sequence":
        weights = torch.exp(masked_sum(log_ratio, mask, -1).clamp(-SAFETY_BOUND, SAFETY_BOUND)).unsqueeze(-1)
        weights = weights.expand_as(log_ratio)
    else:
        raise ValueError(f"rollout_is must be one of {', '.join(IS_LEVELS)}, got {level!r}")
    return torch.where(mask, weights, 0.0)


def truncate(raw: Tensor, upper: float, lower: float | None) -> Tensor:
    """TIS: min(w, U); IcePop (``lower`` given): w·[L ≤ w ≤ U]."""
    if lower is None:
        return raw.clamp(max=upper)
    return torch.where((raw >= lower) & (raw <= upper), raw, 0.0)


def batch_normalise(weights: Tensor, mask: Tensor, level: str) -> tuple[Tensor, Tensor]:
    """(w / w̄, w̄) with w̄ the token mean of w (token level) or the mean over responses with a valid token of
    their weights Σ_t w·m / Σ_t m (sequence level); (w, 1) when w̄ ≤ 1e-8."""
    if level == "token":
        mean = masked_mean(weights, mask)
    else:
        has = mask.any(-1)
        mean = masked_sum(_seq_mean(weights, mask), has) / has.sum().clamp(min=1)
    factor = torch.where(mean > 1e-8, mean, torch.ones_like(mean))
    return weights / factor, factor


def truncated_weights(log_ratio: Tensor, mask: Tensor, settings: RolloutCorrectionSettings) -> tuple[Tensor, Tensor]:
    """(w truncated by the threshold, w_raw before it), detached, 0 at masked tokens."""
    raw = raw_weights(log_ratio.detach(), mask, settings.rollout_is)
    return truncate(raw, settings.is_threshold, settings.is_threshold_lower), raw


def importance_weights(log_ratio: Tensor, response_mask: Tensor, settings: RolloutCorrectionSettings
                       ) -> tuple[Tensor, dict[str, float]]:
    """(IS weights w (B, T) as the loss takes them: truncated, batch-normalised if asked, detached, 0 at masked
    tokens; verl's IS metrics, unprefixed) for ``settings.rollout_is``."""
    mask = response_mask_as_bool(response_mask)
    check_same_shape("log_ratio", log_ratio, "response_mask", response_mask)
    check_has_valid_token(mask)
    weights, raw = truncated_weights(log_ratio, mask, settings)
    metrics = is_metrics(weights, raw, log_ratio.detach(), mask, settings.rollout_is, settings.is_threshold,
                         settings.is_threshold_lower)
    if settings.batch_normalize:
        weights, factor = batch_normalise(weights, mask, settings.rollout_is)
        metrics["rollout_is_batch_norm_factor"] = float(factor)
    return weights, metrics


def _clamped_std(values: Tensor, mask: Tensor, low: float, high: float) -> float:
    """sqrt(max(0, mean(c²) − mean(c)²)), c = clamp(x, low, high), token means; 0 with a single valid token."""
    if int(mask.sum()) <= 1:
        return 0.0
    clamped = values.clamp(min=low, max=high)
    mean = masked_mean(clamped, mask)
    return float(torch.sqrt((masked_mean(clamped.square(), mask) - mean.square()).clamp(min=0.0)))


def _std(values: Tensor) -> float:
    return float(values.std()) if values.numel() > 1 else 0.0


def is_metrics(weights: Tensor, raw: Tensor, log_ratio: Tensor, mask: Tensor, level: str, upper: float,
               lower: float | None) -> dict[str, float]:
    """verl's IS metrics (module doc), unprefixed: ``weights`` truncated, ``raw`` not, both 0 at masked tokens."""
    low = 1.0 / upper if lower is None else lower
    out: dict[str, float] = {"rollout_is_mean": float(masked_mean(weights, mask))}
    if level == "sequence":
        seq_log_ratio = masked_sum(log_ratio, mask, -1)
        out["rollout_is_max"] = math.exp(min(float(seq_log_ratio.max()), SAFETY_BOUND))
        out["rollout_is_min"] = float(torch.exp(seq_log_ratio.min()))
        out["rollout_is_ratio_fraction_high"] = float((seq_log_ratio > math.log(upper)).double().mean())
        out["rollout_is_ratio_fraction_low"] = float((seq_log_ratio < math.log(low)).double().mean())
    else:
        out["rollout_is_ratio_fraction_high"] = float(masked_mean((raw > upper).to(raw.dtype), mask))
        out["rollout_is_ratio_fraction_low"] = float(masked_mean((raw < low).to(raw.dtype), mask))
        out["rollout_is_max"] = float(weights[mask].max())
        out["rollout_is_min"] = float(weights[mask].min())
    out["rollout_is_std"] = _clamped_std(weights, mask, 0.0, upper)
    clamped = weights.clamp(min=0.0, max=upper)
    normalised = clamped / (masked_mean(clamped, mask) + 1e-8)
    out["rollout_is_eff_sample_size"] = float(1.0 / masked_mean(normalised.square(), mask))
    seq = _seq_mean(weights, mask)
    out["rollout_is_seq_mean"] = float(seq.mean())
    out["rollout_is_seq_std"] = _std(seq)
    out["rollout_is_seq_max"] = float(seq.max())
    out["rollout_is_seq_min"] = float(seq.min())
    out["rollout_is_seq_max_deviation"] = float((seq - 1.0).abs().max())
    raw_seq = _seq_mean(raw, mask)
    out["rollout_is_seq_fraction_high"] = float((raw_seq > upper).double().mean())
    out["rollout_is_seq_fraction_low"] = float((raw_seq < low).double().mean())
    if lower is not None:
        out["rollout_is_oob_ratio"] = float(masked_mean(((raw < lower) | (raw > upper)).to(raw.dtype), mask))
    return out


# ---------------------------------------------------------------------------------------------- rejection
def divergences(log_ratio: Tensor) -> dict[str, Tensor]:
    """Per-token k1 = −δ̄, k2 = ½δ̄², k3 = exp(δ̄) − 1 − δ̄."""
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {"k1": -safe, "k2": 0.5 * safe.square(), "k3": torch.exp(safe) - 1.0 - safe}


def rejection_statistic(option: RejectionOption, per_token: Tensor, mask: Tensor) -> tuple[Tensor, Tensor | None]:
    """(the option's statistic per token (B, T): a sequence option's value on each token, its per-response
    value (B,) or None for a token option)."""
    if not option.sequence_level:
        return per_token, None
    if option.name.startswith("seq_sum"):
        seq = masked_sum(per_token, mask, -1)
    elif option.name.startswith("seq_mean"):
        seq = _seq_mean(per_token, mask)
    else:  # seq_max: over valid tokens, 0 for an empty response
        seq = torch.where(mask, per_token, -math.inf).max(-1).values
        seq = torch.where(mask.any(-1), seq, 0.0)
    return seq.unsqueeze(-1).expand_as(per_token), seq


@dataclass(frozen=True)
class OptionRejection:
    option: RejectionOption
    statistic: Tensor  # (B, T)
    per_response: Tensor | None  # (B,) for sequence options
    keep: Tensor  # (B, T) bool


def rejection(log_ratio: Tensor, response_mask: Tensor, options: tuple[RejectionOption, ...]
              ) -> tuple[Tensor, list[OptionRejection]]:
    """(keep (B, T) bool: every option passes, padding included; each option's statistic and keep)."""
    mask = response_mask_as_bool(response_mask)
    check_same_shape("log_ratio", log_ratio, "response_mask", response_mask)
    per_token = divergences(log_ratio.detach())
    keep = torch.ones_like(mask)
    parts = []
    for option in options:
        statistic, seq = rejection_statistic(option, per_token[option.estimator], mask)
        low, high = option.bounds()
        kept = statistic <= high
        if option.lower is not None:
            kept = kept & (statistic >= low)
        keep = keep & kept
        parts.append(OptionRejection(option, statistic, seq, kept))
    return keep, parts


def rejection_metrics(parts: list[OptionRejection], keep: Tensor, mask: Tensor) -> dict[str, float]:
    """verl's RS metrics (module doc), unprefixed."""
    out: dict[str, float] = {}
    has = mask.any(-1)
    for part in parts:
        option, x = part.option, part.statistic
        name = f"rollout_rs_{option.name}"
        low, high = option.bounds()
        k1 = option.lower is not None
        v = (part.per_response if part.per_response is not None else _seq_mean(x, mask))[has]
        out[f"{name}_mean"] = float(masked_mean(x, mask))
        if option.sequence_level:
            out[f"{name}_max"], out[f"{name}_min"] = float(v.max()), float(v.min())
            out[f"{name}_fraction_high"] = float((v > high).double().mean())
            out[f"{name}_fraction_low"] = float((v < low).double().mean()) if k1 else 0.0
        else:
            out[f"{name}_max"], out[f"{name}_min"] = float(x[mask].max()), float(x[mask].min())
            out[f"{name}_fraction_high"] = float(masked_mean((x > high).to(x.dtype), mask))
            out[f"{name}_fraction_low"] = float(masked_mean((x < low).to(x.dtype), mask)) if k1 else 0.0
        out[f"{name}_std"] = _clamped_std(x, mask, low if k1 else 0.0, high)
        out[f"{name}_seq_mean"], out[f"{name}_seq_std"] = float(v.mean()), _std(v)
        out[f"{name}_seq_max"], out[f"{name}_seq_min"] = float(v.max()), float(v.min())
        out[f"{name}_seq_max_deviation"] = float(v.abs().max())
        out[f"{name}_seq_fraction_high"] = float((v > high).double().mean())
        if k1:
            out[f"{name}_seq_fraction_low"] = float((v < low).double().mean())
        rejected = ~part.keep & mask
        out[f"{name}_masked_fraction"] = float(rejected.sum() / mask.sum())
        out[f"{name}_seq_masked_fraction"] = float(rejected.any(-1)[has].double().mean())
    rejected = ~keep & mask
    out["rollout_rs_masked_fraction"] = float(rejected.sum() / mask.sum())
    out["rollout_rs_seq_masked_fraction"] = float(rejected.any(-1).double().mean())
    return out


# ------------------------------------------------------------------------------------------------ together
@dataclass(frozen=True)
class RolloutCorrection:
    weights: Tensor | None  # (B, T) IS weights, None without rollout_is
    response_mask: Tensor  # the mask with rejected tokens removed (the input's dtype)
    metrics: dict[str, float]  # rollout_corr/* of the IS weights and the rejection


def rollout_correction(train_log_probs: Tensor, rollout_log_probs: Tensor, response_mask: Tensor,
                       settings: RolloutCorrectionSettings) -> RolloutCorrection:
    """IS weights, the rejection-narrowed mask and their ``rollout_corr/*`` metrics, over the batch given (verl's
    ``compute_rollout_correction_and_rejection_mask`` less its off-policy diagnostics: ``off_policy_metrics``)."""
    mask = response_mask_as_bool(response_mask)
    check_same_shape("train_log_probs", train_log_probs, "response_mask", response_mask)
    check_same_shape("rollout_log_probs", rollout_log_probs, "response_mask", response_mask)
    check_has_valid_token(mask)
    log_ratio = (train_log_probs - rollout_log_probs).detach()
    metrics: dict[str, float] = {}
    weights = None
    if settings.rollout_is is not None:
        weights, is_part = importance_weights(log_ratio, mask, settings)
        metrics.update(is_part)
    new_mask = response_mask
    if settings.rejection:
        keep, parts = rejection(log_ratio, mask, settings.rejection)
        metrics.update(rejection_metrics(parts, keep, mask))
        new_mask = (mask & keep).to(response_mask.dtype)
    return RolloutCorrection(weights, new_mask, {PREFIX + k: v for k, v in metrics.items()})


def off_policy_metrics(train_log_probs: Tensor, rollout_log_probs: Tensor, response_mask: Tensor
                       ) -> dict[str, float]:
    """verl's off-policy diagnostics (module doc), ``rollout_corr/``-prefixed, over the batch given."""
    mask = response_mask_as_bool(response_mask)
    check_has_valid_token(mask)
    train, rollout = train_log_probs.detach(), rollout_log_probs.detach()
    log_ratio = train - rollout
    train_mean, rollout_mean = _seq_mean(train, mask), _seq_mean(rollout, mask)
    diff = rollout_mean - train_mean
    seq_log_ratio = masked_sum(log_ratio, mask, -1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    out = {
        "training_ppl": float(torch.exp(-train_mean).mean()),
        "training_log_ppl": float((-train_mean).mean()),
        "kl": float(masked_mean(rollout - train, mask)),
        "k3_kl": float(masked_mean(torch.exp(log_ratio) - log_ratio - 1.0, mask)),
        "rollout_ppl": float(torch.exp(-rollout_mean).mean()),
        "rollout_log_ppl": float((-rollout_mean).mean()),
        "log_ppl_diff": float(diff.mean()),
        "log_ppl_abs_diff": float(diff.abs().mean()),
        "log_ppl_diff_max": float(diff.max()),
        "log_ppl_diff_min": float(diff.min()),
        "ppl_ratio": float(torch.exp(diff).mean()),
        "chi2_token": float(masked_mean(torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)).square(), mask) - 1.0),
        "chi2_seq": float(torch.exp(2.0 * seq_log_ratio).mean() - 1.0),
    }
    return {PREFIX + k: v for k, v in out.items()}


# ----------------------------------------------------------------------------------------------- bypass mode
def token_metric_terms(log_ratio: Tensor, raw: Tensor | None, weights: Tensor | None, parts: list[OptionRejection],
                       keep: Tensor | None, settings: RolloutCorrectionSettings) -> dict[str, Tensor]:
    """Per-token terms (B, T) whose token means over the response mask are verl's metrics of the same names
    (``rollout_corr/``-prefixed): those of the IS weights' token means (token level: also the threshold
    fractions), the rejection's masked fractions and option means, and kl, k3_kl, chi2_token."""
    terms: dict[str, Tensor] = {}
    if weights is not None:
        upper, lower = settings.is_threshold, settings.is_threshold_lower
        terms["rollout_is_mean"] = weights
        if settings.rollout_is == "token":
            terms["rollout_is_ratio_fraction_high"] = raw > upper
            terms["rollout_is_ratio_fraction_low"] = raw < (1.0 / upper if lower is None else lower)
        if lower is not None:
            terms["rollout_is_oob_ratio"] = (raw < lower) | (raw > upper)
    for part in parts:
        terms[f"rollout_rs_{part.option.name}_mean"] = part.statistic
        terms[f"rollout_rs_{part.option.name}_masked_fraction"] = ~part.keep
    if keep is not None:
        terms["rollout_rs_masked_fraction"] = ~keep
    terms["kl"] = -log_ratio
    terms["k3_kl"] = torch.exp(log_ratio) - log_ratio - 1.0
    terms["chi2_token"] = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)).square() - 1.0
    return {PREFIX + k: v.detach() for k, v in terms.items()}


BYPASS_DEFAULT = RolloutCorrectionSettings(bypass=True)


@register_policy_loss("bypass_mode")
def bypass_mode(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    rollout_correction: RolloutCorrectionSettings | None = None,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
) -> TokenLoss:
    """verl's bypass-mode loss: ``old_log_prob`` is the rollout engine's log-prob (π_old := π_rollout).

        δ = logπ_θ − logπ_rollout (detached); w, keep from ``rollout_correction`` over this micro-batch
        ppo_clip    L = vanilla PPO's loss at ρ = exp(δ̄) (no IS weights: the ratio already is one)
        reinforce   L = −A · logπ · w           (w = 1 without rollout_is)
        loss mask   response_mask · keep         (TokenLoss.response_mask; without rollout_rs: unchanged)

    metrics: the loss's own (ppo_clip: vanilla's; reinforce: ppo_kl = logπ_rollout − logπ) at kept tokens (0 at
    rejected ones), and the ``rollout_corr/*`` token terms (``token_metric_terms``) at every valid token.
    """
    settings = rollout_correction or BYPASS_DEFAULT
    mask = _check_inputs(log_prob, old_log_prob, advantages, response_mask)
    with torch.no_grad():
        log_ratio = log_prob.detach() - old_log_prob
        raw = weights = applied = None
        if settings.rollout_is is not None:
            weights, raw = truncated_weights(log_ratio, mask, settings)
            applied = batch_normalise(weights, mask, settings.rollout_is)[0] if settings.batch_normalize else weights
        keep, parts = rejection(log_ratio, mask, settings.rejection) if settings.rejection else (None, [])
    if settings.loss_type == "ppo_clip":
        base = vanilla(log_prob, old_log_prob, advantages, response_mask, clip_ratio_low=clip_ratio_low,
                       clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c)
        loss, metrics = base.loss, base.metrics
    elif settings.loss_type == "reinforce":
        loss = -advantages * log_prob * (applied if applied is not None else 1.0)
        metrics = {"ppo_kl": (old_log_prob - log_prob).detach()}
    else:
        raise ValueError(f"rollout_correction.loss_type must be one of {', '.join(LOSS_TYPES)}, "
                         f"got {settings.loss_type!r}")
    if keep is not None:
        metrics = {k: torch.where(keep, v, torch.zeros_like(v)) for k, v in metrics.items()}
    metrics.update(token_metric_terms(log_ratio, raw, weights, parts, keep, settings))
    return TokenLoss(loss=loss, metrics=metrics, response_mask=None if keep is None else mask & keep)
