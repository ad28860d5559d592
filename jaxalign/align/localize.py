"""localize: which policy field, which layer and which module carries the trainer-engine gap.

The engine (policy B) generates the tokens once; then both sides score those tokens teacher-forced, with the
engine side's policy varied one piece at a time and the trainer side fixed at A:
- fields: for each field where A and B differ, the gap with *only* that field switched to B's value
  (`alone`), and how much of the full gap disappears when only that field is switched back to A's value
  (`removed`). The score is the larger of the two.
- parts: `embed`, `layer0..`, `head` taken from A in order (the first i parts under A, the rest under B); a
  part's contribution is how much the gap drops when it joins A.
- modules: only the attention, or only the MoE/MLP blocks, taken from A (the seed's module swap).

Each variant is a program of its own (a policy is static in the compiled forward): 2 per differing field,
n_layers + 2 for the parts, 2 for the modules. `attribute` names the analyses to run, so a study of the fields
alone on a large model does not compile the other n_layers + 4.
"""

from __future__ import annotations

from jaxalign.align.compare import random_prompts
from jaxalign.metrics.mismatch import mismatch_metrics
from jaxalign.metrics.routing import routing_metrics
from jaxalign.engine import Engine
from jaxalign.model.scoring import token_logprobs
from jaxalign.model.sharding import mesh_description
from jaxalign.model.transformer import Transformer
from jaxalign.numerics import NumericPolicy
from jaxalign.numerics.schedule import PolicySchedule
from jaxalign.replay_modes import ENGINE_REPLAY_MODES, check_replay

import numpy as np

ATTRIBUTIONS = ("fields", "parts", "modules")


class _Scorer:
    """Teacher-forced gap between the trainer policy and an engine-side variant on fixed tokens."""

    def __init__(self, model, trainer, tokens, mask, temperature, replay, trainer_mesh=None, engine_mesh=None):
        self.model, self.tokens, self.mask = model, tokens, mask
        self.trainer_mesh, self.engine_mesh = trainer_mesh, engine_mesh
        self.temperature, self.replay = temperature, replay
        self.trainer = trainer
        self._native_trainer = None

    def gap(self, engine_side) -> dict:
        lp_e, rec_e = token_logprobs(self.model, self.tokens, engine_side, temperature=self.temperature,
                                     mesh=self.engine_mesh)
        replay = np.asarray(rec_e.indices) if self.replay == "r3" else None
        lp_t, rec_t = token_logprobs(self.model, self.tokens, self.trainer, temperature=self.temperature,
                                     replay=replay, mesh=self.trainer_mesh)
        metrics = mismatch_metrics(np.asarray(lp_t), np.asarray(lp_e), self.mask)
        flips = routing_metrics(np.asarray(rec_e.indices), np.asarray(rec_t.indices))["route_flip_rate"]
        return {"k3_kl": metrics["k3_kl"], "kl": metrics["kl"], "max_abs_logp_diff": metrics["max_abs_logp_diff"],
                "route_flip_rate": flips}


def localize(model: Transformer, trainer: NumericPolicy, engine: NumericPolicy, *, n_prompts: int = 16,
             max_new_tokens: int = 32, seed: int = 0, temperature: float = 1.0, replay: str = "none",
             trainer_mesh=None, engine_mesh=None, attribute: tuple[str, ...] = ATTRIBUTIONS) -> dict:
    """Attribute the trainer-engine gap to fields, parts and modules. Returns a JSON-ready report whose
    `fields`, `parts` and `modules` lists are each sorted by contribution (largest first).
    `trainer_mesh` / `engine_mesh`: where each side's passes run (None = one device); the mesh difference
    itself is then part of the baseline gap. `attribute`: which of ATTRIBUTIONS to compute (the report's
    `attributed`); the others' lists are left empty, and `culprit` is None without `fields`."""
    check_replay(replay, ENGINE_REPLAY_MODES)
    attribute = check_attributions(attribute)
    diff = trainer.diff(engine)
    if not diff and trainer_mesh is None and engine_mesh is None:
        raise ValueError("trainer and engine policies are identical; there is nothing to localise")
    prompts = random_prompts(model.config.vocab_size, n_prompts, seed,
                             max_len=min(16, model.config.max_seq_len - max_new_tokens))
    rollout = Engine(model, engine, mesh=engine_mesh).generate(prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                                             seed=seed)
    scorer = _Scorer(model, trainer, rollout.tokens, rollout.mask, temperature, replay, trainer_mesh, engine_mesh)
    baseline = scorer.gap(engine)

    fields = []
    for name, a_value, b_value in (diff if "fields" in attribute else ()):
        row = {"field": name, "trainer": a_value, "engine": b_value}
        for label, variant in (("alone", lambda: trainer.replace(**{name: b_value})),
                               ("without", lambda: engine.replace(**{name: a_value}))):
            try:
                row[f"k3_{label}"] = scorer.gap(variant())["k3_kl"]
            except ValueError as err:  # e.g. bf16 accumulation is not valid with an f32 compute dtype
                row[f"k3_{label}"] = None
                row[f"note_{label}"] = str(err)
        removed = None if row["k3_without"] is None else baseline["k3_kl"] - row["k3_without"]
        row["k3_removed"] = removed
        row["score"] = max(v for v in (row["k3_alone"], removed, 0.0) if v is not None)
        fields.append(row)
    fields.sort(key=lambda r: -r["score"])

    part_names = ["embed"] + [f"layer{i}" for i in range(model.config.n_layers)] + ["head"]
    parts, previous = [], baseline["k3_kl"]
    for i, part in enumerate(part_names if "parts" in attribute else ()):
        schedule = PolicySchedule(engine, tuple((p, trainer) for p in part_names[: i + 1]))
        k3 = scorer.gap(schedule)["k3_kl"]
        parts.append({"part": part, "k3_after_joining_trainer": k3, "contribution": previous - k3})
        previous = k3
    parts.sort(key=lambda r: -r["contribution"])

    modules = []
    for module in (("attn", "mlp") if "modules" in attribute else ()):
        gap = scorer.gap(PolicySchedule(engine, ((module, trainer),)))
        modules.append({"module": module, "k3_with_module_from_trainer": gap["k3_kl"],
                        "route_flip_rate": gap["route_flip_rate"],
                        "reduction": baseline["k3_kl"] - gap["k3_kl"]})
    modules.sort(key=lambda r: -r["reduction"])
    return {"trainer": str(trainer), "engine": str(engine), "replay": replay, "baseline": baseline,
            "trainer_mesh": mesh_description(trainer_mesh), "engine_mesh": mesh_description(engine_mesh),
            "attributed": list(attribute), "fields": fields, "parts": parts, "modules": modules,
            "n_tokens": int(rollout.mask.sum()),
            "culprit": (fields[0]["field"] if fields else "mesh") if "fields" in attribute else None}


def check_attributions(attribute) -> tuple[str, ...]:
    """`attribute` as a tuple in ATTRIBUTIONS' order; a clear error for an empty, unknown or repeated name (a
    string is taken as comma-separated names)."""
    names = [n.strip() for n in attribute.split(",")] if isinstance(attribute, str) else list(attribute)
    unknown = [n for n in names if n not in ATTRIBUTIONS]
    if not names or unknown or len(set(names)) != len(names):
        raise ValueError(f"localize attribute={attribute!r}: expected one or more of {', '.join(ATTRIBUTIONS)}, "
                         f"each once" + (f"; unknown: {', '.join(map(repr, unknown))}" if unknown else ""))
    return tuple(n for n in ATTRIBUTIONS if n in names)
