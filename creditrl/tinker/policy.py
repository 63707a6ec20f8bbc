"""One model the Tinker service holds: a base model with LoRA adapters, its tokenizer, and
AdamW over the adapters; every computation is one of creditrl's.

- log-probs: the actor update's forwards: on the CPU its shared-prefix forward
  (``creditrl.workers.prefix_tree``: the datums of one prompt run its tokens once, in token
  order, ``TREE_NODES`` trie nodes per forward/backward; ``tree_log_probs``), else
  ``creditrl.workers.forward.policy_forward`` over padded micro-batches; both end in the
  chunked log-prob function ``creditrl.core.entropy.token_log_probs``;
- losses: ``creditrl.tinker.losses`` (creditrl's policy losses, summed over tokens);
- LoRA: ``creditrl.models.apply_lora`` (peft); AdamW: ``creditrl.workers.optim.build_optimizer``;
- sampling: ``creditrl.rollout.hf_engine.HFRolloutEngine`` over the same module, so a sampled
  token's log-prob is the training forward's (at temperature 1); a LoRA model is sampled from
  its adapters merged into a plain copy the policy keeps across calls (``merged``, refreshed
  once per weight change: ``creditrl.rollout.merged_copy``), equal to float rounding.

A Tinker datum is input tokens x_0..x_{L-1} with one target per position, scored from the
logits at that position: log π(target_t | x_0..x_t). ``datum_batch`` lays it out as creditrl's
prompt/response batch with a one-token prompt x_0 and the targets as the response, so that
``policy_forward``'s column j is exactly that log-prob (spec 000's alignment).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from creditrl.batch import Batch, position_ids_from_mask
from creditrl.config.schema import OptimConfig, RolloutConfig
from creditrl.core.entropy import token_log_probs
from creditrl.models import apply_lora, load_causal_lm, load_tokenizer
from creditrl.models.token_tree import tree_attention_mask
from creditrl.rollout.hf_engine import HFRolloutEngine
from creditrl.rollout.merged_copy import MergedCopy
from creditrl.rollout.sampling import eos_token_ids_of
from creditrl.tinker.losses import check_loss, loss_inputs, tinker_loss
from creditrl.tinker.messages import BadRequest, Datum, SampledSequence
from creditrl.workers.forward import DEFAULT_LOGITS_CHUNK_TOKENS, output_rows, policy_forward
from creditrl.workers.optim import build_optimizer
from creditrl.workers.prefix_tree import build_prefix_tree, resolve_shared_prefix

__all__ = ["AdamStep", "LoraSpec", "Policy", "SampleParams", "datum_batch"]

LORA_ALPHA = 32  # Tinker's LoRA scale is fixed: alpha 32 whatever the rank
MICRO_BATCH_TOKENS = 2048  # positions per forward/backward; losses are sums, so exact
TREE_NODES = 1024  # prefix-tree nodes per forward/backward (attention over them is dense)
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraSpec:
    """LoRA as Tinker asks for it: the rank, an init seed, and which layers get adapters."""

    rank: int
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True

    def to_json(self) -> dict:
        return {
            "rank": self.rank,
            "seed": self.seed,
            "train_mlp": self.train_mlp,
            "train_attn": self.train_attn,
            "train_unembed": self.train_unembed,
        }


@dataclass(frozen=True)
class AdamStep:
    """One ``optim_step``'s Adam parameters, as given (Tinker's names)."""

    learning_rate: float
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass(frozen=True)
class SampleParams:
    """Sampling settings (requests that share them are sampled together): ``stop_ids`` end a
    sample at that token (kept), ``stop_strings`` at the end of the first token completing
    one."""

    max_tokens: int
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    stop_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()


def datum_batch(datums: Sequence[Datum], pad_id: int) -> Batch:
    """Datums as a prompt/response Batch: prompt = x_0, response = the targets, so that
    ``policy_forward`` column j = log π(target_j | x_0..x_j); ``response_mask`` 1 on each
    datum's positions. Every datum must have ``target_tokens``."""
    width = max(len(d.tokens) for d in datums)
    rows = len(datums)
    input_ids = torch.full((rows, 1 + width), pad_id, dtype=torch.long)
    attention = torch.zeros((rows, 1 + width), dtype=torch.long)
    responses = torch.full((rows, width), pad_id, dtype=torch.long)
    for i, datum in enumerate(datums):
        n = len(datum.tokens)
        targets = datum.inputs["target_tokens"].long()
        input_ids[i, :n] = torch.tensor(datum.tokens)
        input_ids[i, n] = targets[-1]
        attention[i, : n + 1] = 1
        responses[i, :n] = targets
    return Batch.from_dict(
        {
            "input_ids": input_ids,
            "attention_mask": attention,
            "position_ids": position_ids_from_mask(attention),
            "responses": responses,
            "response_mask": attention[:, 1:].clone(),
        }
    )


def _row(datum: Datum) -> list[int]:
    """A datum's row as ``datum_batch`` lays it out: its inputs, then its last target."""
    return [*datum.tokens, int(datum.inputs["target_tokens"][-1])]


def _common(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def micro_batches(datums: Sequence[Datum], budget: int, shared: bool) -> list[list[int]]:
    """Datum indices of each forward/backward. ``shared`` (the prefix-tree forward): datums in
    token order, so rows with a common prefix are neighbours, taken while the trie of the
    micro-batch has at most ``budget`` nodes (sorted rows: each adds its length minus its
    common prefix with the one before it); else in the given order while rows x the longest
    row fit ``budget`` (padded). A row over the budget is a micro-batch of its own."""
    rows = [_row(d) for d in datums]
    order = sorted(range(len(rows)), key=rows.__getitem__) if shared else range(len(rows))
    parts: list[list[int]] = []
    load = longest = 0
    previous: list[int] = []
    for i in order:
        row = rows[i]
        if shared:
            cost = load + len(row) - _common(previous, row)
        else:
            cost = (len(parts[-1]) + 1 if parts else 1) * max(longest, len(row))
        if parts and cost <= budget:
            parts[-1].append(i)
            load, longest = cost, max(longest, len(row))
        else:
            parts.append([i])
            load = longest = len(row)
        previous = row
    return parts


def tree_log_probs(
    module: torch.nn.Module, batch: Batch, chunk_tokens: int = DEFAULT_LOGITS_CHUNK_TOKENS
) -> torch.Tensor:
    """``policy_forward``'s log-probs (B, T) of ``datum_batch``'s rows through their prefix
    tree (``workers.prefix_tree``: each distinct prefix runs once, with gradients), the head
    applied once per distinct (prefix, target) pair: rows of one prompt share its positions'
    logits as they share their hidden states, so log pi(target | prefix) is computed once and
    given to every row holding it (the gradient sums over them). Equal to the padded forward up
    to float rounding; where the tree does not pay (``tree_pays``), the padded forward runs."""
    tree = build_prefix_tree(batch, only_if_it_pays=True)
    if tree is None:
        return policy_forward(module, batch, chunk_tokens=chunk_tokens)[0]
    dtype = next(module.parameters()).dtype
    mask = tree_attention_mask(tree.ancestors, module.config._attn_implementation, dtype)
    rows, head = output_rows(
        module,
        tree.logit_nodes,
        input_ids=tree.input_ids,
        attention_mask=mask,
        position_ids=tree.position_ids,
    )
    span = int(tree.labels.max()) + 1  # (node, target) pairs as node * span + target
    pairs, index = torch.unique(tree.logit_index * span + tree.labels, return_inverse=True)
    log_probs, _ = token_log_probs(
        rows[0][pairs // span], pairs % span, head=head, chunk_tokens=chunk_tokens
    )
    valid = tree.response_valid
    return log_probs.new_zeros(valid.shape).index_put((valid,), log_probs[index])


class Policy:
    """A base model (``"embedded"`` or a local directory) with LoRA adapters when ``lora``
    is given, trainable with AdamW over the adapters; ``version`` counts weight changes."""

    def __init__(self, base_model: str, directory: str, lora: LoraSpec | None) -> None:
        self.base_model = base_model
        self.directory = directory
        self.lora = lora
        self.tokenizer = load_tokenizer(directory)
        module = load_causal_lm(directory)
        if lora is not None:
            module.requires_grad_(False)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(lora.seed if lora.seed is not None else 0)
                module = apply_lora(module, lora.rank, LORA_ALPHA, _targets(module, lora))
        self.module = module
        # the LoRA model merged into a plain copy to sample with, shared by the engines of
        # every sample call (one per call), so it merges once per weight change
        self.merged = MergedCopy() if lora is not None else None
        self.optimizer = None
        if lora is not None:
            params = [p for p in module.parameters() if p.requires_grad]
            self.optimizer, _ = build_optimizer(params, OptimConfig(lr=0.0), 1)
        config = module.config
        self.context = int(getattr(config, "max_position_embeddings", 2048) or 2048)
        self.vocab = int(config.vocab_size)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.tokenizer.eos_token_id)
        self.eos_ids = tuple(eos_token_ids_of(module, self.tokenizer))
        # the actor's shared-prefix forward (on the CPU, for models that can run a trie)
        device = next(module.parameters()).device.type
        self.shared_prefix = resolve_shared_prefix("auto", module, device)
        self.version = 0
        self.pending_grad = False

    def trainable(self) -> dict[str, torch.nn.Parameter]:
        """The adapter parameters by name (empty without LoRA)."""
        return {n: p for n, p in self.module.named_parameters() if p.requires_grad}

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """A copy of the adapter weights (a sampler's snapshot)."""
        return {n: p.detach().clone() for n, p in self.trainable().items()}

    def load_adapter(self, state: dict[str, torch.Tensor]) -> None:
        """Copy ``state`` (names and shapes checked) into the adapters."""
        params = self.trainable()
        if set(state) != set(params):
            raise BadRequest("the weights do not fit this model (other adapter names)")
        for name, value in state.items():
            if value.shape != params[name].shape:
                raise BadRequest(f"the weights do not fit this model ({name} has another shape)")
        with torch.no_grad():
            for name, value in state.items():
                params[name].copy_(value)
        self.version += 1

    @contextlib.contextmanager
    def using(
        self, state: dict[str, torch.Tensor] | None, version: int | None = None
    ) -> Iterator[Policy]:
        """Inside the block the module holds ``state`` (None, or taken at this ``version``:
        as it is); restored after."""
        if state is None or version == self.version:
            yield self
            return
        saved, version = self.adapter_state(), self.version
        self.load_adapter(state)
        try:
            yield self
        finally:
            self.load_adapter(saved)
            self.version = version

    def check_datums(self, datums: Sequence[Datum], needs: Sequence[str]) -> None:
        """BadRequest for an empty datum, one past the context, a missing input or a target
        outside the vocabulary."""
        for i, datum in enumerate(datums):
            if not datum.tokens:
                raise BadRequest(f"datum {i} has no input tokens")
            if len(datum.tokens) >= self.context:
                raise BadRequest(f"datum {i} is longer than the model's {self.context} positions")
            if max(datum.tokens) >= self.vocab:
                raise BadRequest(f"datum {i} holds a token id past the vocabulary ({self.vocab})")
            for name in needs:
                if name not in datum.inputs:
                    raise BadRequest(f"datum {i} lacks loss_fn_inputs[{name!r}]")
            targets = datum.inputs["target_tokens"]
            if targets.is_floating_point() or targets.min() < 0 or targets.max() >= self.vocab:
                raise BadRequest(f"datum {i}: target_tokens must be token ids of the vocabulary")
            for name, value in datum.inputs.items():
                if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                    raise BadRequest(f"datum {i}: loss_fn_inputs[{name!r}] is not finite")

    def forward_backward(
        self,
        datums: Sequence[Datum],
        loss_fn: str,
        config: dict[str, float | str],
        forward_only: bool,
    ) -> tuple[list[torch.Tensor], dict[str, float]]:
        """Per-datum target log-probs and the loss metrics; the gradient of the summed loss is
        added to the adapters' (until ``optim_step``) unless ``forward_only``."""
        spec = check_loss(loss_fn, config)
        self.check_datums(datums, spec.inputs)
        if spec.provenance and any(d.recorded is None for d in datums):
            raise BadRequest(f"{loss_fn} needs every datum's recorded sampler log-probs")
        if not forward_only and self.optimizer is None:
            raise BadRequest("this model has no trainable weights")
        sums: dict[str, float] = {}
        tokens = 0.0
        self.module.train(not forward_only)
        outputs = [torch.empty(0)] * len(datums)
        budget = TREE_NODES if self.shared_prefix else MICRO_BATCH_TOKENS
        for indices in micro_batches(datums, budget, self.shared_prefix):
            part = [datums[i] for i in indices]
            batch = datum_batch(part, self.pad_id)
            width = batch["responses"].shape[1]
            inputs = loss_inputs(part, width)
            mask = batch["response_mask"].float()
            with torch.set_grad_enabled(not forward_only):
                if self.shared_prefix:
                    log_prob = tree_log_probs(self.module, batch)
                else:
                    log_prob, _ = policy_forward(self.module, batch)
                # n: the positions trained on, which the loss's ":mean" metrics average over
                loss, metrics, n = tinker_loss(loss_fn, config, log_prob, inputs, mask)
            if not forward_only:
                loss.backward()
                self.pending_grad = True
            tokens += n
            for key, value in metrics.items():
                weight = n if key.endswith(":mean") else 1.0
                sums[key] = sums.get(key, 0.0) + value * weight
            for row, i in enumerate(indices):
                outputs[i] = log_prob[row, : len(datums[i].tokens)].detach().float()
        metrics = {
            key: value / max(tokens, 1.0) if key.endswith(":mean") else value
            for key, value in sums.items()
        }
        return outputs, metrics

    def optim_step(self, step: AdamStep) -> dict[str, float]:
        """One AdamW step with the given parameters over the accumulated gradient (then
        zeroed); ``grad_clip_norm`` > 0 clips the global norm first."""
        if self.optimizer is None:
            raise BadRequest("this model has no trainable weights")
        for value, name in ((step.beta1, "beta1"), (step.beta2, "beta2")):
            if not 0.0 <= value < 1.0:
                raise BadRequest(f"adam {name} must be in [0, 1), got {value}")
        if step.learning_rate < 0 or step.eps <= 0 or step.weight_decay < 0:
            raise BadRequest("adam learning_rate, weight_decay must be >= 0 and eps > 0")
        for group in self.optimizer.param_groups:
            group.update(
                lr=step.learning_rate,
                betas=(step.beta1, step.beta2),
                eps=step.eps,
                weight_decay=step.weight_decay,
            )
        params = list(self.trainable().values())
        max_norm = step.grad_clip_norm if step.grad_clip_norm > 0 else math.inf
        grads = [p for p in params if p.grad is not None]
        norm = float(torch.nn.utils.clip_grad_norm_(grads, max_norm)) if grads else 0.0
        if math.isfinite(norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.pending_grad = False
        self.version += 1
        return {"grad_norm:mean": norm, "learning_rate:mean": step.learning_rate}

    def sample(
        self, requests: Sequence[tuple[list[int], int, int | None]], params: SampleParams
    ) -> list[list[SampledSequence]]:
        """Continuations of several prompts in one HF engine call over this module:
        ``requests`` are (prompt, num_samples, seed or None); each token comes with its
        log-prob under the sampling distribution. Row r of a request with seed s draws from
        the counter-based stream s + r (``counter_uniforms``), so its samples do not depend on
        the other requests sampled with it."""
        for prompt, _, _ in requests:
            if len(prompt) + params.max_tokens > self.context:
                raise BadRequest(
                    f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                    f"the model's {self.context} positions"
                )
            if max(prompt) >= self.vocab:
                raise BadRequest(f"a prompt holds a token id past the vocabulary ({self.vocab})")
        rows = [prompt for prompt, num, _ in requests for _ in range(num)]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(rows):
            ids[i, width - len(row) :] = torch.tensor(row)
            mask[i, width - len(row) :] = 1
        seeds = [
            torch.arange(num) + (seed if seed is not None else int(torch.randint(1 << 62, ())))
            for _, num, seed in requests
        ]
        cfg = RolloutConfig(
            max_response_length=params.max_tokens,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            micro_batch_size=len(rows),
        )
        engine = HFRolloutEngine(
            self.module,
            self.tokenizer,
            cfg,
            eos_token_ids=params.stop_ids,
            merged_copy=self.merged,
        )
        prompts = {"input_ids": ids, "attention_mask": mask, "sample_seed": torch.cat(seeds)}
        out = engine.generate(Batch.from_dict(prompts), greedy=params.temperature == 0)
        lengths = out["response_mask"].sum(-1).tolist()
        sequences = []
        for i, length in enumerate(lengths):
            tokens = out["responses"][i, :length].tolist()
            logprobs = out["rollout_log_probs"][i, :length].tolist()
            stopped = bool(tokens) and tokens[-1] in params.stop_ids
            cut = self._stop_string_end(tokens, params.stop_strings)
            if cut is not None:
                tokens, logprobs, stopped = tokens[:cut], logprobs[:cut], True
            sequences.append(SampledSequence(tokens, logprobs, "stop" if stopped else "length"))
        out_lists, start = [], 0
        for _, num, _ in requests:
            out_lists.append(sequences[start : start + num])
            start += num
        return out_lists

    def _stop_string_end(self, tokens: list[int], stops: Sequence[str]) -> int | None:
        """The length of the shortest prefix of ``tokens`` whose text holds a stop string."""
        if not stops or not any(s in self.tokenizer.decode(tokens) for s in stops):
            return None
        for end in range(1, len(tokens) + 1):
            text = self.tokenizer.decode(tokens[:end])
            if any(s in text for s in stops):
                return end
        return None

    @torch.no_grad()
    def prompt_logprobs(self, prompt: list[int]) -> list[float]:
        """log π(x_t | x_<t) for t >= 1 of ``prompt``, NaN at t = 0 (nothing precedes it)."""
        if len(prompt) < 2:
            return [math.nan] * len(prompt)
        datum = Datum(prompt[:-1], {"target_tokens": torch.tensor(prompt[1:])})
        self.module.eval()
        log_prob, _ = policy_forward(self.module, datum_batch([datum], self.pad_id))
        return [math.nan, *log_prob[0, : len(prompt) - 1].tolist()]


def _targets(module: torch.nn.Module, lora: LoraSpec) -> str | list[str]:
    """The LoRA target modules the flags select, for Llama-like names; else every linear."""
    names = {name.rsplit(".", 1)[-1] for name, _ in module.named_modules()}
    if not set(_ATTN + _MLP) <= names:
        return "all-linear"
    targets = [*(_ATTN if lora.train_attn else ()), *(_MLP if lora.train_mlp else ())]
    if lora.train_unembed and "lm_head" in names:
        targets.append("lm_head")
    if not targets:
        raise BadRequest("LoRA needs at least one of train_attn, train_mlp, train_unembed")
    return targets
